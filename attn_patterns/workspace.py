"""What an attention call holds in memory beyond its q, k, v and its output, for the memory
planner (``sparse_ft.plan``): each pattern states its own (``Pattern.workspace``), from the
arithmetic of one kernel call here.

Why here: how much a pattern holds is a fact of its kernels (how many calls, over which
rows and heads, whether pieces are merged), not of the planner, so a newly registered pattern
is planned by what it declares and never as dense attention by default.

One fused call (FlashAttention-2 in torch or flash-attn, cuDNN's, the memory-efficient kernel)
keeps its fp32 log-sum-exp from forward to backward; its backward holds an fp32 accumulator for
dQ (rows × heads × D), the fp32 row sums of dO·O, the gradients dQ, dK and dV, and, when K/V
have fewer heads than q (GQA), dK and dV per *query* head before they are summed onto the K/V
heads (FlashAttention-2's ``dk_expanded``/``dv_expanded``). Measured on an H200 (torch 2.11,
SDPA's cuDNN kernel, Llama-3.1-8B's 32/8 heads, bf16): 45,184 bytes per token in the backward's
own allocations, which is these five terms to the byte. The math kernel instead keeps its fp32
probabilities (rows × width scores) and, in backward, the gradients of the scores and of the
probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

KERNELS = ("fused", "math")  # fused: no scores held (flash / cuDNN / memory-efficient / CPU); math: scores materialised


@dataclass(frozen=True)
class Workspace:
    """Bytes by named term. ``saved``: held from the call's forward until its backward (so
    through the rest of the layer's backward); ``backward``: held only while its backward runs."""

    saved: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)

    def scaled(self, factor: float) -> "Workspace":
        """Every term times ``factor`` (the batch: each sequence attends alone)."""
        return Workspace({k: v * factor for k, v in self.saved.items()},
                         {k: v * factor for k, v in self.backward.items()})


def kernel_call(rows: int, keys: int, *, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                kernel: str = "fused", width: Optional[int] = None) -> Workspace:
    """One call: ``rows`` queries and ``keys`` keys per head (blocks folded into the batch
    count as rows and keys), ``heads`` query heads over ``kv_heads`` K/V heads; ``width`` keys
    scored per query row (the math kernel's scores; default ``keys``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is unknown; allowed: {', '.join(KERNELS)}")
    a, d = dtype_bytes, head_dim
    grads = {"attention backward: dQ, dK, dV": a * d * (heads * rows + 2 * kv_heads * keys)}
    if kernel == "math":
        scores = heads * rows * (keys if width is None else width)
        return Workspace({"attention probabilities (math kernel, fp32)": 4 * scores},
                         {**grads, "attention backward: score gradients (math kernel, fp32)": 8 * scores})
    backward = {"attention backward: dQ accumulator (fp32)": 4 * heads * rows * d,
                "attention backward: row sums of dO·O (fp32)": 4 * heads * rows, **grads}
    if kv_heads < heads:
        backward["attention backward: dK, dV per query head (GQA)"] = 2 * a * heads * keys * d
    return Workspace({"attention log-sum-exp (fp32)": 4 * heads * rows}, backward)


def pieces(parts: list[Workspace], *, rows: int, heads: int, kv_heads: int, head_dim: int,
           dtype_bytes: int) -> Workspace:
    """A pattern computed as pieces (blocks, head groups, strided views) whose outputs are
    merged into one ``(B, H, N, D)`` output: every piece's saved terms; the merged output
    beside the pieces' own, which the model's ``(B, N, H, D)`` layout then copies (one Q-wide
    tensor more than one dense call, whose kernel writes that layout directly: measured on
    the tiny model on CPU and on an H200); in backward, the largest piece's call (they run
    one after another) and the pieces' dQ, dK, dV, held until merged into q's, k's and v's.
    A piece that is itself merged from pieces is counted once, at the outermost merge."""
    a, d = dtype_bytes, head_dim
    saved: dict[str, float] = {}
    for part in parts:
        for name, size in part.saved.items():
            saved[name] = saved.get(name, 0.0) + size
    saved["pattern output merged, in the model's layout (o_proj's input)"] = a * heads * rows * d
    largest = max(parts, key=lambda p: sum(p.backward.values()))
    backward = {**largest.backward,
                "attention backward: pieces' dQ, dK, dV until merged": a * d * rows * (heads + 2 * kv_heads)}
    return Workspace(saved, backward)
