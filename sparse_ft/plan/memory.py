"""Peak memory per GPU of one training step, by named term, from the shapes and the recipe's keys.

A prediction of what the allocator holds at the step's peak (``torch.cuda.max_memory_allocated``),
not of what ``nvidia-smi`` shows: the CUDA context, NCCL's buffers and the allocator's
fragmentation are left to :data:`HEADROOM`. The terms and what each assumes are in
docs/memory.md; scripts/plan_check.py and scripts/fit_length.py compare them with
measurements. Every term is linear in the tokens ``t`` a rank holds, except the math kernel's
attention scores.

The step's peak is in the backward of the last decoder layer (every checkpointed input still
held, that layer recomputed, the gradient of its output flowing), in the loss's backward (the
final hidden states and a chunk's logits), or at the end of backward, where a trainable
embedding's new dense gradient exists beside the accumulated one: whichever holds most, as
they never coexist. Inside the layer's backward, what is held changes as autograd frees each
op's saved tensors after its backward: at the MLP (one tile at a time when tiled), at the
post-attention norm just after it, and at attention, each its own sum (:func:`layer_phases`).

What attention holds comes from the pattern itself (``Pattern.workspace``, registered with the
pattern), or, for ``full``, from the model's own dense kernel call: no list of names here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from attn_patterns.checks import MAX_LENGTH
from attn_patterns.workspace import Workspace, kernel_call
from sparse_ft.plan.geometry import ModelShape

GIB = 2**30
HEADROOM = 0.10  # of the GPU's memory, for the CUDA context, NCCL buffers and fragmentation
# tokens: longest_fit's ceiling, the longest any run may ask for; a longer fit is reported as "more than this"
SEARCH_LIMIT = MAX_LENGTH
# bitsandbytes NF4 with double quantisation: 4 bits, an 8-bit absmax per 64 weights, an fp32
# scale (and offset) per 256 absmax values
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# which activation each LoRA target reads (its A matrix keeps that input for its gradient)
LORA_INPUT = {"q_proj": "norm1", "k_proj": "norm1", "v_proj": "norm1", "gate_proj": "norm2", "up_proj": "norm2",
              "o_proj": "attention", "down_proj": "mlp"}
MLP_TENSORS = 6  # gate, up, activation (forward) and the gradients of the product, activation and up (backward)


@dataclass(frozen=True)
class Setup:
    """What of a recipe the memory depends on (``sparse_ft.plan.cli.setup_from_recipe``).
    ``pattern`` is any trainable name of ``sparse_ft.methods`` with its ``pattern_params``."""

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
    pattern_params: dict[str, Any] = field(default_factory=dict)
    kernel: str = "fused"  # fused: SDPA's flash / cuDNN / memory-efficient / CPU kernels; math: scores materialised
    batch: int = 1
    dense_layers: int = 0  # layers attending fully (the pattern causal): attention.dense_layers, resolved
    dense_tail: bool = False  # train.dense_final_fraction > 0: the last steps attend fully in every layer
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


def norm_output_bytes(setup: Setup) -> int:
    """An RMSNorm's output is its weight times the normalised input in the residual's dtype,
    type-promoted: fp32 where either is (plain torch trains the norms as fp32 masters)."""
    weight = 4 if setup.zero_stage == 0 and "norm" in setup.extra_trainable else _act_bytes(setup)
    return max(residual_bytes(setup), weight)


def projection_output_bytes(setup: Setup) -> int:
    """What a frozen projection answers in: bitsandbytes' NF4 layers in their input's dtype
    (so fp32 after an fp32 norm), a half-precision ``nn.Linear`` under autocast in half."""
    return norm_output_bytes(setup) if setup.quantization == "nf4" else _act_bytes(setup)


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


def attention_pattern(setup: Setup):
    """The pattern ``setup.pattern`` names, or None for a method that leaves attention to the
    model's own dense kernel (``full``); resolved by ``sparse_ft.methods`` as a recipe's
    ``attention.pattern`` is, so an unknown or training-free name is refused here too."""
    from sparse_ft import methods
    from sparse_ft.methods.pattern import PatternMethod

    method = methods.get(setup.pattern, "pattern", **setup.pattern_params)
    if not method.supports.training:
        raise ValueError(f"pattern={setup.pattern!r} cannot train (a training-free method); allowed: "
                         f"{', '.join(methods.trainable_names())}")
    if isinstance(method, PatternMethod):
        return method.pattern
    if method.replaces_attention:
        raise ValueError(f"pattern={setup.pattern!r}: the planner has no memory model for this method's attention")
    return None


def attention_workspace(setup: Setup, n: int) -> Workspace:
    """What one layer's attention holds beyond its q, k, v and output, per rank: the pattern's
    own declaration, or the model's dense kernel call. Under Ulysses a rank attends with
    ``heads / sp`` heads over the whole sequence (each sequence of the batch alone)."""
    s, a = setup.shape, _act_bytes(setup)
    pattern = attention_pattern(setup)
    if pattern is None:
        call = kernel_call(n, n, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, dtype_bytes=a, kernel=setup.kernel)
    else:
        call = pattern.workspace(n, s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, dtype_bytes=a, kernel=setup.kernel)
    return call.scaled(setup.batch / setup.sequence_parallel)


def _lora_inputs(setup: Setup, source: str, width: int, in_bytes: int) -> float:
    """Bytes per token the LoRA targets reading ``source`` keep: under autocast each casts an
    input wider than the model's dtype to its own copy; otherwise they share the input."""
    count = sum(LORA_INPUT.get(m) == source for m in setup.lora_targets)
    a = _act_bytes(setup)
    if not count:
        return 0.0
    return (count * a if in_bytes > a else in_bytes) * width


def layer_saved(setup: Setup, n: int) -> dict[str, dict[str, float]]:
    """What the layer's forward keeps for backward, per rank, in two groups: ``attention``
    (until attention's backward, the last of the layer's big ones) and ``middle`` (between
    attention and the MLP, freed just before attention's backward). Autograd keeps only what
    a gradient needs and the base is frozen: a projection without LoRA keeps no input.
    Counted with the allocator's history on an H200 (docs/memory.md)."""
    s, a, r = setup.shape, _act_bytes(setup), residual_bytes(setup)
    t = tokens_per_rank(setup, n)
    norm = 4 * s.hidden if r == 4 else (4 + a) * s.hidden  # the fp32 normalised input (and an fp32 upcast)
    attention = {
        "input norm's kept input (fp32)": norm * t,
        "LoRA inputs of q, k, v": _lora_inputs(setup, "norm1", s.hidden, norm_output_bytes(setup)) * t,
        "LoRA A outputs": a * setup.lora_r * len(setup.lora_targets) * t,
        "attention inputs q, k, v": a * (s.q_width + 2 * s.kv_width) * t,
        "attention output": a * s.q_width * t,
        **attention_workspace(setup, n).saved,
    }
    if setup.sequence_parallel > 1:  # q, k, v and output counted Q-wide: an upper bound where k and v are narrower (GQA)
        attention["Ulysses all-to-all buffers"] = 4 * a * s.q_width * t
    middle = {"residual after attention": r * s.hidden * t, "post-attention norm's kept input (fp32)": norm * t}
    return {"attention": attention, "middle": middle}


def mlp_working_set(setup: Setup, t: int) -> float:
    """One MLP call's gate, up and activation and, in its backward, the gradients of their
    product, of the activation and of up (:data:`MLP_TENSORS`, in the projections' output
    dtype), with the inputs its LoRA targets keep: over one tile of ``mlp_tile_tokens``
    positions when tiled (each tile is recomputed in backward: sparse_ft/train/activations.py)."""
    s = setup.shape
    m = min(t, setup.mlp_tile_tokens) if setup.mlp_tile_tokens else t
    e = projection_output_bytes(setup)
    lora = (_lora_inputs(setup, "norm2", s.hidden, norm_output_bytes(setup))
            + _lora_inputs(setup, "mlp", s.intermediate, e))
    return (MLP_TENSORS * e * s.intermediate + lora) * m


def layer_phases(setup: Setup, n: int) -> dict[str, dict[str, float]]:
    """The recomputed layer's backward at its three largest moments, each by term, per rank:
    at the MLP (the tiles' shared input still held and the gradients of finished tiles
    gathered for their concatenation), at the post-attention norm just after it (the MLP's
    input gradient whole, the norm's fp32 backward), and at attention (its own backward
    workspace, the post-attention tensors freed)."""
    s, a, r = setup.shape, _act_bytes(setup), residual_bytes(setup)
    t = tokens_per_rank(setup, n)
    saved = layer_saved(setup, n)
    before, middle = saved["attention"], saved["middle"]
    grad = {"residual stream gradient": r * s.hidden * t}
    e = norm_output_bytes(setup)
    tiled = bool(setup.mlp_tile_tokens) and setup.mlp_tile_tokens < t
    mlp = {**before, **middle, **grad}
    if tiled:
        mlp["MLP input, kept by its tiles"] = e * s.hidden * t
        mlp["MLP input gradient, gathered from the tiles"] = e * s.hidden * t
    span = f"a tile of {setup.mlp_tile_tokens:,}" if tiled else "whole"
    mlp[f"MLP working set ({span}, forward + backward)"] = mlp_working_set(setup, t)
    norm = {**before, **middle, **grad, "MLP input gradient": e * s.hidden * t,
            "post-attention norm's backward (fp32)": 2 * 4 * s.hidden * t}
    attention = {**before, **grad, "attention output gradient": a * s.q_width * t,
                 **attention_workspace(setup, n).backward}
    return {"at the MLP": mlp, "at the post-attention norm": norm, "at attention": attention}


def layer_kept(setup: Setup, n: int) -> float:
    """What one layer holds from its forward to its backward without gradient checkpointing:
    its saved tensors and its MLP's (gate, up and activation, or a tiled MLP's input)."""
    s = setup.shape
    t = tokens_per_rank(setup, n)
    saved = layer_saved(setup, n)
    if setup.mlp_tile_tokens and setup.mlp_tile_tokens < t:
        mlp = norm_output_bytes(setup) * s.hidden * t
    else:
        mlp = MLP_TENSORS // 2 * projection_output_bytes(setup) * s.intermediate * t
    return sum(saved["attention"].values()) + sum(saved["middle"].values()) + mlp


def loss_working_set(setup: Setup, t: int) -> float:
    """The loss's backward: one chunk's logits (model dtype), their fp32 upcast, the log-softmax
    and its gradient; the model's own loss holds all ``t`` tokens' at once."""
    s, a = setup.shape, _act_bytes(setup)
    per_logit = a + (4 if a < 4 else 0) + 8
    tokens = min(t, setup.loss_chunk_tokens) if setup.loss == "chunked" else t
    return per_logit * tokens * s.vocab


def dense(setup: Setup) -> Setup:
    """``setup`` with full attention in every layer: the pattern ``causal`` (what the dense
    layers and a dense tail run), on the pattern's backend."""
    backend = {k: v for k, v in setup.pattern_params.items() if k == "backend"}
    return replace(setup, pattern="causal", pattern_params=backend, dense_layers=0, dense_tail=False)


def layer_kinds(setup: Setup) -> dict[str, tuple[Setup, int]]:
    """The layers by how they attend: a label, the setup of their attention and how many.
    Dense layers (``attention.dense_layers``) attend as :func:`dense` does."""
    layers = setup.shape.layers
    full = min(setup.dense_layers, layers)  # a shape cut to fewer layers keeps those it has
    kinds = {"last layer's": (setup, layers - full), "a full-attention layer's": (dense(setup), full)}
    return {label: kind for label, kind in kinds.items() if kind[1]}


def layer_candidates(setup: Setup, n: int) -> dict[str, dict[str, float]]:
    """The backward of the last layer of each kind (:func:`layer_kinds`) at each of its
    moments, by term: under gradient checkpointing that layer's alone, without it every
    earlier layer's saved tensors as well."""
    kinds = layer_kinds(setup)
    kept = 0 if setup.gradient_checkpointing else sum(count * layer_kept(kind, n) for kind, count in kinds.values())
    out = {}
    for label, (kind, _) in kinds.items():
        earlier = {} if setup.gradient_checkpointing else {"earlier layers' saved tensors": kept - layer_kept(kind, n)}
        out.update({f"{label} backward {moment}": {**earlier, **terms} for moment, terms in layer_phases(kind, n).items()})
    return out


def phases(setup: Setup, n: int) -> dict[str, dict[str, float]]:
    """Each candidate for the step's peak beyond the static memory, by term: the layers'
    backward (:func:`layer_candidates`), with a dense tail the all-dense step's layers' too
    (the run's peak is the larger), the loss's backward, and the end of backward."""
    s = setup.shape
    t = tokens_per_rank(setup, n)
    r = residual_bytes(setup)
    out = layer_candidates(setup, n)
    if setup.dense_tail:
        out.update({f"dense tail, {name}": terms for name, terms in layer_candidates(dense(setup), n).items()})
    out["loss backward"] = {"final hidden states (norm input and output)": (8 + r) * t * s.hidden,
                            "loss " + ("chunk" if setup.loss == "chunked" else "logits"): loss_working_set(setup, t)}
    out["end of backward"] = {"embedding's new gradient": embedding_gradient(setup)}
    return out


def components(setup: Setup, n: int) -> dict[str, float]:
    """Bytes per GPU at the step's peak for sequences of ``n`` tokens, by term: the static
    memory, the activations every phase holds, and the terms of the phase that holds most
    (each named ``phase: term``)."""
    s = setup.shape
    t = tokens_per_rank(setup, n)
    r = residual_bytes(setup)
    parts = {**weights(setup), **optimizer_state(setup)}
    if setup.gradient_checkpointing:
        kept = 1 if setup.offload_activations else s.layers
        where = " (1 layer; the rest on the CPU)" if setup.offload_activations else ""
        parts["checkpointed layer inputs" + where] = kept * t * s.hidden * r
    # computed once per forward in the residual's dtype, read by every layer's backward
    parts["RoPE cos/sin tables"] = 2 * r * s.head_dim * t
    candidates = phases(setup, n)
    name = max(candidates, key=lambda k: sum(candidates[k].values()))
    parts.update({f"{name}: {term}": size for term, size in candidates[name].items()})
    return parts


def phase_totals(setup: Setup, n: int) -> dict[str, float]:
    """Each candidate phase's bytes beyond the static memory (the largest is the peak's)."""
    return {name: sum(terms.values()) for name, terms in phases(setup, n).items()}


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


def longest_fit(setup: Setup, budget: float, *, granule: int = 1024, limit: int = SEARCH_LIMIT) -> Optional[int]:
    """The longest sequence (a multiple of ``granule`` and of ``sequence_parallel``) whose
    predicted peak stays within ``budget`` bytes, by bisection (the peak grows with N); None
    when not even one granule fits. The search stops one step past ``limit``: a result above
    ``limit`` means more than ``limit`` tokens fit (how many more is not searched)."""
    step = granule * setup.sequence_parallel // math.gcd(granule, setup.sequence_parallel)
    if peak(setup, step) > budget:
        return None
    lo, hi = 1, limit // step + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(setup, mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step
