"""Peak memory per GPU of one training step, by component, from the shapes and the recipe's keys.

A prediction of what the allocator holds at the step's peak (``torch.cuda.max_memory_allocated``),
not of what ``nvidia-smi`` shows: the CUDA context, NCCL's buffers and the allocator's
fragmentation are left to :data:`HEADROOM`. The terms and what each assumes are in
docs/memory.md; scripts/plan_check.py compares them with measurements. Every term is linear in
the tokens ``t`` a rank holds, except the attention scores of the math kernel.

The step's peak is in the backward of the last decoder layer (every checkpointed input still
held, that layer recomputed, the gradient of its output flowing), in the loss's backward (the
final hidden states and a chunk's logits), or at the end of backward, where a trainable
embedding's new dense gradient exists beside the accumulated one: whichever holds most, as
they never coexist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from sparse_ft.plan.geometry import ModelShape

GIB = 2**30
HEADROOM = 0.10  # of the GPU's memory, for the CUDA context, NCCL buffers and fragmentation
# bitsandbytes NF4 with double quantisation: 4 bits, an 8-bit absmax per 64 weights, an fp32
# scale (and offset) per 256 absmax values
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# patterns computed in blocks (their q, k, v copied into SDPA's folded batch), with the block
# width as a fraction of N: chunked ones N / chunks, the dilated ones every ``dilation``-th token
CHUNKED = {"s2", "scca_fixed", "scca_flow", "longmixed", "local"}
DILATED = {"sda": 2}


@dataclass(frozen=True)
class Setup:
    """What of a recipe the memory depends on (``from_recipe``)."""

    shape: ModelShape
    dtype: str = "bfloat16"
    quantization: str = "none"
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    extra_trainable: tuple[str, ...] = ("embed_tokens", "norm")
    gradient_checkpointing: bool = True
    offload_activations: bool = False
    mlp_tile_tokens: int = 0
    loss: str = "chunked"
    loss_chunk_tokens: int = 2048
    zero_stage: int = 0  # 0: plain torch (no DeepSpeed)
    offload_optimizer: bool = False
    world_size: int = 1
    sequence_parallel: int = 1
    pattern: str = "scca_flow"
    chunks: int = 4
    kernel: str = "fused"  # fused: SDPA's flash / memory-efficient / CPU kernels; math: scores materialised
    batch: int = 1
    notes: tuple[str, ...] = field(default=())


def trainable_params(setup: Setup) -> dict[str, int]:
    """LoRA's A and B on every target projection, and the tensors LoRA+ trains whole (PEFT's
    ``modules_to_save``, matched by name suffix: ``norm`` is every RMSNorm)."""
    s = setup.shape
    shapes = s.linear_shapes()
    lora = s.layers * sum(setup.lora_r * (shapes[m][0] + shapes[m][1]) for m in setup.lora_targets if m in shapes)
    whole = 0
    if "embed_tokens" in setup.extra_trainable:
        whole += s.embedding_params()
    if "norm" in setup.extra_trainable:
        whole += s.norm_params()
    if "lm_head" in setup.extra_trainable:
        whole += s.embedding_params()
    return {"lora": lora, "whole": whole}


def _act_bytes(setup: Setup) -> int:
    return DTYPE_BYTES[setup.dtype]


def residual_bytes(setup: Setup) -> int:
    """Bytes per element of the residual stream (the checkpointed layer inputs). Plain torch
    keeps trainable tensors as fp32 masters under autocast: a trainable embedding hands the
    decoder fp32 hidden states, and each residual add of a half-precision output keeps fp32.
    DeepSpeed's module parameters are in the model's dtype."""
    if setup.zero_stage == 0 and "embed_tokens" in setup.extra_trainable:
        return 4
    return _act_bytes(setup)


def weights(setup: Setup) -> dict[str, float]:
    s, a = setup.shape, _act_bytes(setup)
    linear = s.layers * s.layer_linear_params()
    rest = s.norm_params() + s.embedding_params() + s.head_params()
    linear_bytes = linear * NF4_BITS / 8 if setup.quantization == "nf4" else linear * a
    shard = setup.world_size if setup.zero_stage == 3 else 1
    parts = {"weights": (linear_bytes + rest * a) / shard}
    if setup.zero_stage == 3 and setup.world_size > 1:  # the layer in use and the one prefetched, gathered
        parts["weights gathered (ZeRO-3)"] = 2 * s.layer_linear_params() * (NF4_BITS / 8 if setup.quantization == "nf4" else a)
    return parts


def optimizer_state(setup: Setup) -> dict[str, float]:
    """Trainable tensors, their gradients and AdamW's m and v. Plain torch: fp32 masters (4 B),
    fp32 gradients (4), m and v (8). DeepSpeed with a half-precision model: the module's copy
    (2, partitioned by ZeRO-3), its gradients (2, by ZeRO-2 and 3), fp32 master, m and v (12,
    by every stage, or on the CPU with offload_optimizer); an fp32 model has no separate master."""
    n = sum(trainable_params(setup).values())
    if setup.zero_stage == 0:
        return {"trainable + grads + AdamW (fp32)": 16 * n}
    a = _act_bytes(setup)
    w = setup.world_size
    states = (12 if a < 4 else 8) * n
    return {"trainable + grads + AdamW (ZeRO)": a * n / (w if setup.zero_stage == 3 else 1)
            + a * n / (w if setup.zero_stage >= 2 else 1)
            + (0 if setup.offload_optimizer else states / w)}


def tokens_per_rank(setup: Setup, n: int) -> int:
    return setup.batch * -(-n // setup.sequence_parallel)


def layer_working_set(setup: Setup, t: int) -> float:
    """What one decoder layer's forward keeps for backward (its recomputation under gradient
    checkpointing), plus the gradients alive in its backward, per rank. Autograd keeps only what
    a gradient needs, and the base's weights are frozen: a projection without LoRA keeps no
    input. Per token, as counted on the tiny model (docs/memory.md): each RMSNorm's
    normalised input in fp32 (and, for a half-precision residual, its fp32 upcast: the norm's
    weight trains), the first norm's output (LoRA's input on q/k/v), the residual after
    attention, LoRA A's outputs, q and k after RoPE, v, the attention output and o_proj's
    contiguous input, the MLP's gate, up and activation (3 × I, per tile when tiled; the
    product feeds the frozen down_proj and is not kept); in backward, the residual stream's
    gradient twice."""
    s, a, r = setup.shape, _act_bytes(setup), residual_bytes(setup)
    mlp_tokens = min(t, setup.mlp_tile_tokens) if setup.mlp_tile_tokens else t
    norm = 4 * s.hidden if r == 4 else (4 + a) * s.hidden
    lora = a * setup.lora_r * len(setup.lora_targets)
    per_token = 2 * norm + a * s.hidden + r * s.hidden + lora + a * (3 * s.q_width + 2 * s.kv_width)
    return per_token * t + 3 * a * s.intermediate * mlp_tokens + 2 * r * s.hidden * t


def attention_workspace(setup: Setup, n: int) -> dict[str, float]:
    """One layer's attention beyond what :func:`layer_working_set` counts, per rank. Under
    Ulysses a rank holds ``heads / sp`` heads over the whole sequence, and the all-to-all's q,
    k, v and output buffers. Fused kernels (flash on sm80+, memory-efficient, the CPU kernel)
    keep the output and its log-sum-exp, no scores; blocked patterns keep q, k, v in SDPA's
    folded batch instead of the model's layout and one output-wide copy more (counted on the
    tiny model: one Q-wide tensor per token more than full attention). The math kernel
    materialises each block's fp32 scores, their softmax and its gradient."""
    s, a = setup.shape, _act_bytes(setup)
    sp = setup.sequence_parallel
    heads, q = s.heads / sp, s.q_width / sp
    tokens = setup.batch * n
    parts = {"attention (lse)": 4 * heads * tokens}
    blocked = setup.pattern in CHUNKED or setup.pattern in DILATED or setup.pattern == "causal"
    if blocked:
        parts["attention (pattern copies)"] = a * q * tokens
    if setup.kernel == "math":
        width = n / setup.chunks if setup.pattern in CHUNKED else n / DILATED.get(setup.pattern, 1)
        parts["attention scores (math kernel)"] = 3 * 4 * heads * tokens * width
    if sp > 1:  # q, k, v and output counted Q-wide: an upper bound where k and v are narrower (GQA)
        parts["Ulysses all-to-all buffers"] = 4 * a * q * tokens
    return parts


def loss_working_set(setup: Setup, t: int) -> float:
    """The loss's backward: one chunk's logits (model dtype), their fp32 upcast, the log-softmax
    and its gradient; the model's own loss holds all ``t`` tokens' at once."""
    s, a = setup.shape, _act_bytes(setup)
    per_logit = a + (4 if a < 4 else 0) + 8
    tokens = min(t, setup.loss_chunk_tokens) if setup.loss == "chunked" else t
    return per_logit * tokens * s.vocab


def components(setup: Setup, n: int) -> dict[str, float]:
    """Bytes per GPU at the step's peak for sequences of ``n`` tokens, by component."""
    s = setup.shape
    t = tokens_per_rank(setup, n)
    r = residual_bytes(setup)
    parts = {**weights(setup), **optimizer_state(setup)}
    if setup.gradient_checkpointing:
        kept = 1 if setup.offload_activations else s.layers
        parts["checkpointed layer inputs" + (" (1 layer; the rest on the CPU)" if setup.offload_activations else "")] = kept * t * s.hidden * r
        layer = layer_working_set(setup, t) + sum(attention_workspace(setup, n).values())
    else:
        layer = s.layers * (layer_working_set(setup, t) + sum(attention_workspace(setup, n).values()))
    final = (8 + r) * t * s.hidden  # the final norm's input and output, which the loss reads
    phases = {"layer recomputed + attention (backward)": layer,
              "final hidden states + loss " + ("chunk" if setup.loss == "chunked" else "logits") + " (backward)":
                  final + loss_working_set(setup, t),
              "embedding's new gradient (end of backward)": embedding_gradient(setup)}
    name = max(phases, key=phases.get)
    parts[name] = phases[name]
    return parts


def embedding_gradient(setup: Setup) -> float:
    """A trainable embedding's gradient is dense (``V × H``) and made whole by its backward, the
    last of the step, before it is added to the accumulated one: fp32 under plain torch (the
    master's), the model's dtype under DeepSpeed."""
    if "embed_tokens" not in setup.extra_trainable:
        return 0.0
    return (4 if setup.zero_stage == 0 else _act_bytes(setup)) * setup.shape.embedding_params()


def host_offload(setup: Setup, n: int) -> float:
    """Host memory the offloaded checkpoints take (per GPU's process)."""
    if not (setup.gradient_checkpointing and setup.offload_activations):
        return 0.0
    return setup.shape.layers * tokens_per_rank(setup, n) * setup.shape.hidden * residual_bytes(setup)


def peak(setup: Setup, n: int) -> float:
    return sum(components(setup, n).values())


def longest_fit(setup: Setup, budget: float, *, granule: int = 1024, limit: int = 1 << 26) -> Optional[int]:
    """The longest sequence (a multiple of ``granule`` and of ``sequence_parallel``) whose
    predicted peak stays within ``budget`` bytes, by bisection (the peak grows with N); None
    when not even one granule fits."""
    step = granule * setup.sequence_parallel // math.gcd(granule, setup.sequence_parallel)
    if peak(setup, step) > budget:
        return None
    lo, hi = 1, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(setup, mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


