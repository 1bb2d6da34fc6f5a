"""``--method``: what the model attends with at evaluation, applied per evaluated length.

* ``full`` — the model as loaded (an adapter's trained RoPE included);
* any attention-pattern name — the pattern through ``use_attention`` (ppl only: patterns
  define no KV-cache decoding);
* ``pi`` / ``ntk`` / ``yarn`` — training-free RoPE scaling through transformers' own
  configuration, factor = evaluated length ÷ the model's context (no change within it);
* methods registered by other modules (Dual Chunk Attention, LongHeads, ParallelComp) with
  :func:`register`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import attn_patterns
from sparse_ft import rope
from sparse_ft.attention import use_attention


class Method:
    """Prepare ``model`` for sequences of ``length`` tokens. ``generate`` (optional) takes over
    passkey generation; ``supports_ppl = False`` makes ``eval ppl`` refuse with ``why``."""

    name = "full"
    supports_ppl = True
    why_no_ppl = ""
    generate: Optional[Callable] = None

    def __init__(self, **params: Any) -> None:
        if params:
            raise ValueError(f"--method {self.name} takes no --method-arg; got {', '.join(params)}")

    def apply(self, model: torch.nn.Module, length: int) -> None:
        pass


class PatternMethod(Method):
    def __init__(self, name: str, **params: Any) -> None:
        self.name = name
        self.pattern = attn_patterns.get(name, **params)

    def apply(self, model, length):
        use_attention(model, self.pattern)


class RopeMethod(Method):
    """The factor follows the evaluated length, so the configuration the model was loaded with
    is restored before each length."""

    def __init__(self, kind: str) -> None:
        self.name, self.kind = kind, {"pi": "linear", "ntk": "dynamic", "yarn": "yarn"}[kind]
        self._original: Optional[tuple[dict, int]] = None

    def apply(self, model, length):
        config = _base(model).config
        if self._original is None:
            self._original = (rope.rope_parameters(config), config.max_position_embeddings)
        rope.restore(config, *self._original)
        rope.extend_to(config, length, self.kind)
        rope.refresh_rotary(_base(model))


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


_REGISTRY: dict[str, Callable[..., Method]] = {
    "full": Method,
    "pi": lambda **p: _no_params(RopeMethod("pi"), p),
    "ntk": lambda **p: _no_params(RopeMethod("ntk"), p),
    "yarn": lambda **p: _no_params(RopeMethod("yarn"), p),
}


def _no_params(method: Method, params: dict) -> Method:
    if params:
        raise ValueError(f"--method {method.name} takes no --method-arg (its factor follows the evaluated length); got {', '.join(params)}")
    return method


def register(name: str, factory: Callable[..., Method]) -> None:
    _REGISTRY[name] = factory


def names() -> list[str]:
    return sorted(set(_REGISTRY) | set(attn_patterns.names()))


def get(name: str, **params: Any) -> Method:
    if name in _REGISTRY:
        try:
            return _REGISTRY[name](**params)
        except TypeError as err:
            raise ValueError(f"--method {name}: {err}") from None
    if name in attn_patterns.names():
        return PatternMethod(name, **params)
    raise ValueError(f"--method {name!r} is unknown; allowed: {', '.join(names())}")
