"""LongHeads inside a transformers model (the maths: ``attn_patterns.longheads``): what the
pure algorithm cannot know by itself: the RoPE frequencies the model rotated q/k with, its
pretraining length, and which positions a call covers when a KV cache is in use.

One path serves prefill, chunked prefill and cached decoding: the call's queries are the last
``Nq`` of the ``Nk`` cached positions. Decoding needs the queries of the chunk being filled to
build its representation once it is complete (paper §2.4), and the cache keeps only keys and
values, so each attention layer carries a small state: the complete chunks' representations
and the queries since the last complete chunk, per group of sequences of a padded batch (each
sequence, and each packed document, runs alone: :mod:`sparse_ft.methods.sequences`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, Optional

import torch

from attn_patterns.kernels import LSE_BACKENDS
from attn_patterns.longheads import LongHeads, chunk_representations, longheads_attention
from sparse_ft.modeling import rope
from sparse_ft.methods.base import AlgorithmMethod, Supports, register
from sparse_ft.methods.sequences import algorithm_spans, per_span

_STATE_ATTR = "_longheads_state"


@register
class LongHeadsMethod(AlgorithmMethod):
    name = "longheads"
    algorithm_class = LongHeads
    supports = Supports(training=False, ppl=True, kv_cache=True, backends=(None, *LSE_BACKENDS))

    def __call__(self, module, query, key, value, attention_mask, *, scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """q (B,H,Nq,D), k/v (B,Hkv,Nk,D) -> (B,Nq,H,D)."""
        self.check_inputs(attention_mask, dropout)
        spans = algorithm_spans(attention_mask, kwargs, q=query, k=key, owner="longheads")
        algorithm = self.algorithm
        config = module.config
        chunks = algorithm.window(algorithm.pretraining_length or rope.original_context(config))
        inv_freq = rope.rope_inv_freq(config, "longheads").to(query.device)  # cheap; never stale after a RoPE change
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if query.shape[2] == key.shape[2]:  # a new batch: forget the last one's sequences
            setattr(module, _STATE_ATTR, {})

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Hashable) -> torch.Tensor:
            reps = _update_state(module, q, k, v, group=group, chunk_size=algorithm.chunk_size, inv_freq=inv_freq)
            return longheads_attention(q, k, v, reps=reps, chunk_size=algorithm.chunk_size, chunks=chunks,
                                       inv_freq=inv_freq, scale=scale, keep_previous=algorithm.keep_previous,
                                       backend=algorithm.backend)

        return per_span(attend, query, key, value, spans=spans).transpose(1, 2).contiguous(), None


def _update_state(module, query, key, value, *, group: Hashable, chunk_size: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Representations (B,H,M,D) of every complete chunk of the ``Nk`` tokens of the sequences
    ``group`` names, reusing those computed at earlier calls of the same sequences."""
    nq, nk = query.shape[2], key.shape[2]
    start = nk - nq
    states = getattr(module, _STATE_ATTR, None) or {}
    state = states.get(group)
    if start == 0:  # a new sequence
        state = {"tokens": 0, "reps": query.new_zeros(*query.shape[:2], 0, query.shape[-1], dtype=torch.float32),
                 "pending": query[:, :, :0]}
    elif state is None or state["tokens"] != start or state["reps"].shape[0] != query.shape[0]:
        seen = None if state is None else state["tokens"]
        raise ValueError(
            f"longheads: the cache holds {start} tokens but this layer's state saw {seen}; LongHeads decodes "
            "one sequence forward from its own prefill (no cache reuse, reordering or beam search)"
        )
    done = state["reps"].shape[2]
    queries = torch.cat((state["pending"], query), dim=2)  # positions done·l .. nk-1
    complete = nk // chunk_size
    if complete > done:
        span = slice(done * chunk_size, complete * chunk_size)
        new = chunk_representations(queries[:, :, : (complete - done) * chunk_size], key[:, :, span], value[:, :, span],
                                    chunk_size=chunk_size, first_chunk=done, inv_freq=inv_freq)
        state["reps"] = torch.cat((state["reps"], new), dim=2)
    state["pending"] = queries[:, :, (complete - done) * chunk_size :]
    state["tokens"] = nk
    states[group] = state
    setattr(module, _STATE_ATTR, states)
    return state["reps"]
