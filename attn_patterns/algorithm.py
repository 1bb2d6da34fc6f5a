"""What DCA and LongHeads are: attention algorithms that move keys to other RoPE positions
(DCA) or pick them from the data (LongHeads).

They are not patterns. A :class:`~attn_patterns.base.Pattern` is a fixed set of visible keys
that a kernel, a mask and a pair count all read, and it runs on q/k whatever their
positions; an algorithm has no such set to hand out, and it needs what a pattern never
does: the RoPE inverse frequencies q and k are rotated with, because it rotates them again.
That need is the whole protocol below. Inside a model each algorithm runs through a method
of its own (``sparse_ft.methods``), which reads the frequencies from the model's config and
keeps what KV-cache decoding needs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from attn_patterns.checks import check_qkv
from attn_patterns.registry import Registry
from attn_patterns.rotary import default_inv_freq, rotate


class Algorithm:
    """Base class. A subclass registered with :func:`register` takes its parameters as
    keyword arguments of its constructor (the list recipes and ``--method-arg`` are checked
    against, through its method) and implements :meth:`attend`."""

    name: str = "algorithm"

    def __init__(self, **params: Any) -> None:
        self.params = params

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 inv_freq: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
        """Whole-sequence output (B,H,N,D) of q (B,H,N,D) and k/v (B,Hkv,N,D) given *before*
        RoPE: they are rotated at positions 0..N-1 with ``inv_freq`` (None: base 10000 over all
        of D), as a model hands them over, then :meth:`attend` runs. For tests and pictures."""
        check_qkv(q, k, v)
        inv_freq = default_inv_freq(q.shape[-1]) if inv_freq is None else inv_freq
        inv_freq = inv_freq.to(q.device)
        positions = torch.arange(q.shape[2], device=q.device)
        q, k = rotate(q, positions, inv_freq), rotate(k, positions, inv_freq)
        return self.attend(q, k, v, inv_freq=inv_freq, backend=backend)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               inv_freq: Optional[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
        """The same for q/k already rotated at positions 0..N-1 with ``inv_freq`` (None: a
        model without RoPE); ``backend`` picks the log-sum-exp kernel (None: automatic)."""
        raise NotImplementedError


ALGORITHMS: Registry[Algorithm] = Registry("algorithm", Algorithm)
register = ALGORITHMS.register
