"""Training-free RoPE scaling baselines: ``pi`` (linear position interpolation), ``ntk``
(dynamic NTK) and ``yarn``, as transformers' own ``linear``, ``dynamic`` and ``yarn`` rope
types through :func:`sparse_ft.modeling.rope.extend_to`. Attention stays the model's own.

The factor follows the evaluated length (length ÷ the model's current context, composed with
any scaling it already has, e.g. an adapter's; 1 within the context), so the configuration
the model was loaded with is restored before each length and scaled from there.
``factor=F`` fixes one factor for every length instead (LongLoRA's eval scales by
``ceil(context / original)``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sparse_ft.modeling import rope
from sparse_ft.modeling.attention import pretrained
from sparse_ft.methods.base import Method, Supports, register


class RopeScaling(Method):
    kind = "linear"  # the transformers rope_type written
    supports = Supports(training=False, ppl=True, kv_cache=True)
    replaces_attention = False

    def __init__(self, factor: Optional[float] = None) -> None:
        if factor is not None and not (isinstance(factor, (int, float)) and factor >= 1):
            raise ValueError(f"--method-arg factor={factor!r} must be a number >= 1")
        self.factor = factor
        self._loaded: Optional[tuple[dict, int]] = None

    def max_length(self, config: Any) -> Optional[int]:
        """The scaling follows the length asked up to ``rope.MAX_FACTOR`` in total; a fixed
        ``factor`` reaches the context times it."""
        if self.factor is None:
            return int(rope.context_length(config) * rope.MAX_FACTOR / float(rope.rope_parameters(config)["factor"]))
        return round(rope.context_length(config) * self.factor)

    def apply(self, model: torch.nn.Module, length: int) -> None:
        base = pretrained(model)
        config = base.config
        if self._loaded is None:
            self._loaded = (rope.rope_parameters(config), config.max_position_embeddings)
        rope.restore(config, *self._loaded)
        if self.factor is None:
            rope.extend_to(config, length, self.kind)
        else:
            rope.scale_rope(config, float(self.factor), self.kind)
        rope.refresh_rotary(base)


@register
class PositionInterpolation(RopeScaling):
    name, kind = "pi", "linear"


@register
class DynamicNTK(RopeScaling):
    name, kind = "ntk", "dynamic"


@register
class YaRN(RopeScaling):
    name, kind = "yarn", "yarn"
