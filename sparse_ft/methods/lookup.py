"""Names to methods: every place that takes a method by name (recipes, ``--method``, the
experiment's rows, ``sparse_ft.use_attention``) asks here, so a name means the same thing
everywhere. Methods come from ``METHODS``, patterns from ``attn_patterns.PATTERNS`` through
:class:`PatternMethod`; a name is looked up in both and must be in one."""

from __future__ import annotations

from typing import Any, Callable, Optional

from attn_patterns import PATTERNS, Algorithm, Pattern
from attn_patterns.registry import Registry
from attn_patterns.kernels import auto_backend
from sparse_ft.methods.base import METHODS, Method, Supports
from sparse_ft.methods.pattern import PatternMethod


def names(where: Optional[Callable[[Supports], bool]] = None) -> list[str]:
    """Registered methods in registration order, then the patterns; with ``where``, those
    that build from their name alone whose class's ``supports`` satisfies it
    (``names(lambda s: s.training)``), read from the classes without building one."""
    every = METHODS.names() + [n for n in PATTERNS.names() if n not in METHODS]
    if where is None:
        return every
    return [n for n in every if _by_name_alone(n) and where(supports(n))]


def supports(name: str) -> Supports:
    """What the method ``name`` serves, read from its class (every pattern's is
    :class:`PatternMethod`'s)."""
    return PatternMethod.supports if name in PATTERNS and name not in METHODS else METHODS.factory(name).supports


def trainable_names() -> list[str]:
    """What a recipe's ``attention.pattern`` (and ``plan --patterns``) may name, in
    :func:`names`' order, read from the registries' classes without building one: every
    pattern trains, a method says so in its class's ``supports.training`` (``mixed``, which
    needs parameters to build, is listed too)."""
    return [n for n in names() if n in PATTERNS or METHODS.factory(n).supports.training]


def _by_name_alone(name: str) -> bool:
    """Whether ``name`` means one thing and has a default for every parameter (``mixed`` has
    no default parts)."""
    if name in METHODS and name in PATTERNS:
        return False
    return not (PATTERNS if name in PATTERNS else METHODS).required(name)


def _named(flag: str, name: str) -> str:
    return f"{flag} {name!r}" if flag.startswith("--") else f"{flag}={name!r}"


def get(name: str, flag: str = "--method", /, **params: Any) -> Method:
    """The method ``name`` with ``params``; errors name ``flag`` (the CLI flag or recipe key
    the name came from). A pattern's name gives it through :class:`PatternMethod`. A name
    must mean one thing: one registered both as a method and as a pattern is refused."""
    registry = _checked_names(name, flag, params)
    built = registry.get(name, **params)
    return PatternMethod(built) if registry is PATTERNS else built


def check(name: str, flag: str = "--method", /, **params: Any) -> None:
    """What :func:`get` would refuse, without building the method: the name, the parameter
    names against its class's signature and their values by its class-level check
    (``Registry.check``)."""
    _checked_names(name, flag, params).check(name, **params)


def _checked_names(name: str, flag: str, params: dict[str, Any]) -> "Registry[Any]":
    """The registry holding ``name``, once ``name`` and the parameter names are known good."""
    if name in METHODS and name in PATTERNS:
        raise ValueError(f"{_named(flag, name)} is registered both as a method (sparse_ft.methods) and as a pattern "
                         "(attn_patterns); names must be unique across the two: rename one")
    as_pattern = name in PATTERNS
    registry = PATTERNS if as_pattern else METHODS
    if name not in registry:
        raise ValueError(f"{_named(flag, name)} is unknown; allowed: {', '.join(names())}")
    allowed = registry.parameters(name)
    unknown = ", ".join(sorted(set(params) - set(allowed)))
    cli = flag.startswith("--")
    if unknown and not allowed:
        raise ValueError(f"{flag} {name} takes no --method-arg; got {unknown}" if cli else f"{name} takes no parameters; got {unknown}")
    if unknown:
        detail = f"{name}: parameter(s) {unknown} unknown; allowed: {', '.join(allowed)}"
        raise ValueError(f"{flag} {name}: bad --method-arg ({detail})" if cli else detail)
    return registry


def as_method(spec: "str | Method | Pattern", flag: str = "--method", /, **params: Any) -> Method:
    """A method from a name (with ``params``), a Method, or a Pattern object; an Algorithm
    object is refused, since it runs in a model only through its method."""
    if isinstance(spec, str):
        return get(spec, flag, **params)
    if params:
        raise ValueError(f"parameters {sorted(params)} go with a name, not with the ready object {spec!r}")
    if isinstance(spec, Method):
        return spec
    if isinstance(spec, Pattern):
        return PatternMethod(spec)
    if isinstance(spec, Algorithm):
        raise ValueError(
            f"{spec!r} moves positions or picks keys from the data, so it is no pattern a model can run as it is; "
            f"use its method: sparse_ft.methods.get({spec.name!r}, ...)"
        )
    raise ValueError(f"{spec!r} is neither a method name, a Method nor a Pattern")


def check_training(name: str, params: dict, backend: Optional[str]) -> None:
    """What :func:`for_training` refuses, without building the method: a recipe is checked
    here when it loads and built once, by the run. ``auto`` is checked as the default backend
    every method takes: which backend it becomes is the training machine's to say. Every
    error says which recipe key is wrong."""
    trainable = trainable_names()
    if name not in trainable:
        why = "cannot train (it is a training-free method)" if name in names() else "is unknown"
        raise ValueError(f"pattern={name!r} {why}; allowed: {', '.join(trainable)}")
    check(name, "pattern", **params)
    if backend is not None and "backend" in params:
        raise ValueError(f"attention.backend={backend!r} and attention.params.backend={params['backend']!r} both choose "
                         "the kernel; set one of them")
    backends = supports(name).backends
    if backend != "auto" and backend not in backends:
        raise ValueError(f"attention.backend={backend!r} is not one {name} runs on; allowed: {', '.join(map(str, backends))}")


def for_training(name: str, params: dict, backend: Optional[str], dtype: str) -> tuple[Method, Optional[str]]:
    """The method a recipe trains through, built once, and its backend with ``auto``
    resolved on this machine among the backends the method takes (flash-attn only where it
    can run: CUDA, fp16/bf16, installed)."""
    check_training(name, params, backend)
    if backend == "auto":
        backend = auto_backend(dtype != "float32", supports(name).backends)
    chosen = {} if backend is None else {"backend": backend}
    return get(name, "pattern", **params, **chosen), backend
