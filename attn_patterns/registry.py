"""Name -> factory tables, one per kind of thing (attention patterns and algorithms here,
methods in ``sparse_ft.methods``), filled where things are defined::

    @PATTERNS.register                 # a class: registered under its ``name``
    class Causal(Pattern): name = "causal"

    @PATTERNS.register                 # a function: registered under its own name
    def sink(window: int = 64) -> Pattern: ...

A factory's keyword parameters are the parameters a user may pass: :meth:`Registry.get`
checks names against its signature, so a typo in a recipe fails with the allowed list, and
:meth:`Registry.check` also checks their values by the factory's class-level
``check_params``, without building anything (a recipe stays data until the run builds it).
A name is taken once: registering it again is refused (as PEFT and lm-evaluation-harness
refuse theirs), so a second definition can never silently replace the one every recipe,
``--method`` and table reads. A name may carry tags (lm-evaluation-harness's task tags), the
selections a default reads, ``names(tag="scca_table2")``, rather than a list of names beside
the registry. This module imports nothing of its package, so any layer can own a registry.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, Iterable, Optional, TypeVar

T = TypeVar("T")


def origin(factory: Callable[..., Any]) -> str:
    """Where a factory was defined, ``module.qualname``: what a duplicate-name error names."""
    module = getattr(factory, "__module__", None) or "?"
    return f"{module}.{getattr(factory, '__qualname__', repr(factory))}"


class Registry(Generic[T]):
    """``kind`` names the thing in errors ("pattern", "method"); ``base`` is the type that
    :meth:`build` passes through unchanged."""

    def __init__(self, kind: str, base: type) -> None:
        self.kind, self.base = kind, base
        self._factories: dict[str, Callable[..., T]] = {}
        self._tags: dict[str, frozenset[str]] = {}

    def register(self, factory: "Callable[..., T] | str | None" = None, *, name: Optional[str] = None,
                 tags: Iterable[str] = ()) -> Any:
        """Add ``factory`` under ``name`` (default: a class's ``name`` attribute, a function's
        ``__name__``) with ``tags``; usable bare, as ``register("name")`` or as
        ``register(name=..., tags=...)`` decorators, or called with the factory. A name already
        taken raises ValueError naming both definitions; :meth:`remove` frees it first."""
        if isinstance(factory, str):
            factory, name = None, factory

        def add(f: Callable[..., T]) -> Callable[..., T]:
            key = name or (f.__dict__.get("name") if isinstance(f, type) else None) or f.__name__
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.kind} name={key!r} must be a non-empty string")
            if key in self._factories:
                raise ValueError(
                    f"{self.kind} name {key!r} is already taken by {origin(self._factories[key])}; refusing to "
                    f"replace it with {origin(f)}: register that under another name (or remove {key!r} first)"
                )
            self._factories[key] = f
            self._tags[key] = frozenset(tags)
            return f

        return add if factory is None else add(factory)

    def remove(self, name: str) -> None:
        """Take ``name`` out again (tests that register a toy)."""
        self._factories.pop(name, None)
        self._tags.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._factories

    def names(self, tag: Optional[str] = None) -> list[str]:
        """In registration order: the order tables and help texts list them in; with ``tag``, the
        names registered with it (a tag no name carries raises ValueError with those in use)."""
        if tag is None:
            return list(self._factories)
        used = sorted(set().union(*self._tags.values()))
        if tag not in used:
            raise ValueError(f"{self.kind} tag={tag!r} is unknown; allowed: {', '.join(used) or 'none'}")
        return [n for n in self._factories if tag in self._tags[n]]

    def parameters(self, name: str) -> list[str]:
        return list(inspect.signature(self._factories[name]).parameters)

    def required(self, name: str) -> list[str]:
        """The parameters ``name`` has no default for: none, and it builds from its name alone."""
        return [p.name for p in inspect.signature(self.factory(name)).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def factory(self, name: str) -> Callable[..., T]:
        """The registered factory itself: a class whose class attributes say more than building
        one does (an evaluation task's command-line flags)."""
        if name not in self._factories:
            raise ValueError(f"{self.kind}={name!r} is unknown; allowed: {', '.join(sorted(self._factories))}")
        return self._factories[name]

    def get(self, name: str, **params: Any) -> T:
        """Build ``name``; unknown names or parameters raise ValueError listing what exists."""
        self._check_names(name, params)
        return self._factories[name](**params)

    def check(self, name: str, **params: Any) -> None:
        """What :meth:`get` would refuse, without building anything: the parameter names
        against the factory's signature, then their values by the factory's class-level
        ``check_params(**params)`` where it has one (the classmethod its constructor calls
        first, so a value is refused by one piece of code either way). A recipe stays data:
        it is checked here, and built once, by the run."""
        self._check_names(name, params)
        check_params = getattr(self._factories[name], "check_params", None)
        if check_params is not None:
            check_params(**params)

    def _check_names(self, name: str, params: dict[str, Any]) -> None:
        self.factory(name)
        allowed = self.parameters(name)
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"{name}: parameter(s) {', '.join(unknown)} unknown; allowed: {', '.join(allowed) or 'none'}")
        missing = [p for p in self.required(name) if p not in params]
        if missing:
            raise ValueError(f"{name}: parameter(s) {', '.join(missing)} required (it has no default); allowed: {', '.join(allowed)}")

    def build(self, spec: Any) -> T:
        """From a name, a ``{"name": ..., **params}`` dict or a ready object."""
        if isinstance(spec, self.base):
            return spec
        name, params = self._named(spec)
        return self.get(name, **params)

    def check_spec(self, spec: Any) -> None:
        """What :meth:`build` would refuse, without building (:meth:`check`)."""
        if not isinstance(spec, self.base):
            name, params = self._named(spec)
            self.check(name, **params)

    def _named(self, spec: Any) -> tuple[str, dict[str, Any]]:
        """A name or a ``{"name": ..., **params}`` dict as the name and its parameters."""
        if isinstance(spec, str):
            return spec, {}
        if isinstance(spec, dict) and "name" in spec:
            return spec["name"], {k: v for k, v in spec.items() if k != "name"}
        raise ValueError(f"{self.kind} spec {spec!r} must be a name, a {{'name': ..., params}} dict or a {self.base.__name__}")
