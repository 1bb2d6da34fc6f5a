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
        self._longest = 0  # the longest length asked (check_length), for check_model

    def check_length(self, seq_len: int) -> None:
        """Kept: whether the model can be scaled that far is known once its config is
        (:meth:`check_model`, before the weights load)."""
        self._longest = max(self._longest, seq_len)

    def check_model(self, config: Any) -> None:
        """The longest length asked, scaled as :meth:`apply` will scale it, within
        ``rope.MAX_FACTOR`` of the model's pretraining context: refused in one line before the
        weights load rather than at the first length."""
        try:
            if self.factor is not None:
                rope.check_factor(config, float(self.factor))
            elif self._longest:
                rope.check_factor(config, rope.extension_factor(config, self._longest))
        except ValueError as err:
            asked = f"--method-arg factor={self.factor:g}" if self.factor is not None else f"length {self._longest:,}"
            raise ValueError(f"--method {self.name} at {asked}: {err}") from None

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
