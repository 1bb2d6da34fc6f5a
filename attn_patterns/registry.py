"""Name -> pattern factory. Other modules (training-free methods) add theirs with
:func:`register`, as a call or a decorator::

    @register("dca")
    def dca(chunk_size: int = 1024, backend: str | None = None) -> Pattern: ...

A factory's keyword parameters are the pattern's parameters: :func:`get` checks names
against its signature, so a typo in a recipe fails with the allowed list."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from attn_patterns import patterns
from attn_patterns.base import Pattern

_FACTORIES: dict[str, Callable[..., Pattern]] = {
    "full": patterns.full,
    "s2": patterns.s2,
    "scca_fixed": patterns.scca_fixed,
    "scca_flow": patterns.scca_flow,
    "sda": patterns.sda,
    "longmixed": patterns.longmixed,
    "mixed": patterns.mixed,
}


def register(name: str, factory: Optional[Callable[..., Pattern]] = None) -> Callable[..., Any]:
    """Add ``factory`` under ``name`` (replacing an earlier one); without ``factory``, a
    decorator doing the same. Returns the factory."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"pattern name={name!r} must be a non-empty string")

    def add(f: Callable[..., Pattern]) -> Callable[..., Pattern]:
        _FACTORIES[name] = f
        return f

    return add if factory is None else add(factory)


def names() -> list[str]:
    return sorted(_FACTORIES)


def get(name: str, **params: Any) -> Pattern:
    """Build pattern ``name``; unknown names or parameters raise ValueError listing what exists."""
    if name not in _FACTORIES:
        raise ValueError(f"pattern={name!r} is unknown; allowed: {', '.join(names())}")
    factory = _FACTORIES[name]
    allowed = inspect.signature(factory).parameters
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: parameter(s) {', '.join(unknown)} unknown; allowed: {', '.join(allowed)}")
    return factory(**params)


def build(spec: Any) -> Pattern:
    """A pattern from a name, a ``{"name": ..., **params}`` dict or a Pattern."""
    if isinstance(spec, Pattern):
        return spec
    if isinstance(spec, str):
        return get(spec)
    if isinstance(spec, dict) and "name" in spec:
        params = {k: v for k, v in spec.items() if k != "name"}
        return get(spec["name"], **params)
    raise ValueError(f"pattern spec {spec!r} must be a name, a {{'name': ..., params}} dict or a Pattern")
