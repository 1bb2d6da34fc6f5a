"""Dual Chunk Attention inside a transformers model (the maths: ``attn_patterns.dca``).

One path serves prefill, chunked prefill and cached decoding: the call's ``Nq`` queries are
the last of ``Nk`` positions, everything rotated at its true position with the model's own
RoPE frequencies (so DCA composes with any scaling in them), and DCA needs no state.
The model supplies what the pure pattern cannot know: ``c`` defaults to the context it
handles now (``config.max_position_embeddings``) and the frequencies come from its config.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from attn_patterns.dca import DualChunkAttention, dca_attention
from attn_patterns.kernels import LSE_BACKENDS
from sparse_ft.methods.base import PatternBacked, Supports, register
from sparse_ft.rope import rope_inv_freq


@register
class DualChunk(PatternBacked):
    name = "dca"
    pattern_class = DualChunkAttention
    supports = Supports(training=False, ppl=True, kv_cache=True, padding=("right",), backends=(None, *LSE_BACKENDS))

    def __call__(self, module, query, key, value, attention_mask, scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        nq, nk = query.shape[2], key.shape[2]
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"dca: expected the 2-D padding mask, got attention_mask of shape {tuple(attention_mask.shape)}")
        self.check_inputs(attention_mask, dropout)
        window = kwargs.get("sliding_window")
        if window is not None and window < nk:
            raise ValueError(
                f"dca: sliding_window={window} is shorter than the sequence ({nk}); DCA assumes global causal attention"
            )
        positions = kwargs.get("position_ids")
        if positions is not None:
            expected = torch.arange(nk - nq, nk, device=positions.device)
            if positions.shape[-1] != nq or not bool((positions == expected).all()):
                raise ValueError(
                    "dca: position_ids must be the token indices (0..N-1 over the cache); packed sequences and left "
                    "padding are not supported"
                )
        p = self.pattern
        config = module.config
        s, w, c = p.sizes(int(config.max_position_embeddings))
        inv_freq = rope_inv_freq(config, "dca").to(query.device)
        out = dca_attention(query, key, value, inv_freq, s, w, c, scale=scaling, backend=p.backend,
                            variant=p.variant, pieces=p.pieces)
        return out.transpose(1, 2).contiguous(), None
