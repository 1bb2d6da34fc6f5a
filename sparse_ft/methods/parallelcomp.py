"""ParallelComp (Xiong et al., 2025): answer a query over a context longer than the model's
pretraining length by encoding context chunks in parallel and attending over the best few.

Why a query is needed: chunks are ranked by how well each one predicts the query, the
self-information ``I_c = -log P(query | chunk)`` (paper eq. 3). So the method answers
questions (passkey, QA); it assigns no probability to the context itself and has no
standard perplexity (``PPL_UNSUPPORTED``).

Steps (paper §3.1), all through transformers' own forward and KV cache:

1. split the context into chunks of ``chunk_size`` tokens (default: pretraining length minus
   the query, so that chunk + query fits: paper App. C);
2. encode ``batch_chunks`` chunks at a time as ``[chunk, query]`` rows (left padded), each at
   positions 0.. (positions are reused, never extrapolated);
3. score each chunk by I_c and keep the ``keep_chunks`` lowest in a fixed-size heap, streaming
   over batches so at most ``keep_chunks + batch_chunks`` chunks' KV exist at once;
4. optionally evict KV inside each chunk by the cumulative attention the last
   ``score_window`` query tokens pay to it (eq. 5): keep the ``kv_budget`` highest
   (compression), and/or drop tokens whose attention exceeds ``calibration_threshold`` in the
   sink / middle / recency region chosen per layer depth (calibration, eq. 7);
5. the query attends to the kept chunks' KV concatenated in original order (eq. 8–10),
   placed after the longest kept chunk; then greedy decoding continues on that cache.
"""

from __future__ import annotations

import heapq
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from attn_patterns.checks import check_int
from sparse_ft.modeling import rope
from sparse_ft.modeling.attention import current_method, install_method, pretrained
from sparse_ft.methods.base import Method, Supports, greedy, model_device, register
from sparse_ft.methods.pattern import ModelAttention

PPL_UNSUPPORTED = (
    "ParallelComp ranks context chunks by the self-information of a query (-log P(query | chunk)); "
    "it scores a question, not the context, so it has no standard perplexity. "
    "Use `eval passkey --method parallelcomp`"
)

# Paper App. C (Llama-2, 32 layers): layers 1-8 evict middle-bias tokens, 9-16 recency-bias,
# 25-32 sink-bias; as fractions of depth so it applies to any layer count.
PAPER_CALIBRATION_LAYERS: dict[str, tuple[float, float]] = {"middle": (0.0, 0.25), "recency": (0.25, 0.5), "sink": (0.75, 1.0)}


@dataclass
class ParallelCompConfig:
    """Defaults are the paper's (App. C) where it gives one."""

    chunk_size: Optional[int] = None  # tokens per chunk; None: pretraining length - query length
    keep_chunks: int = 3  # priority-queue size K (LongBench 3; InfiniteBench retrieval 1)
    # eq. 4's τ on I_c (nats, summed over the question): only chunks with I_c <= τ enter the
    # queue; None = off (the paper's τ values are read as λ, see docs/parallelcomp.md)
    self_information_threshold: Optional[float] = None
    batch_chunks: int = 4  # chunks encoded in one forward (memory knob; the paper runs 20 + 3)
    kv_budget: Optional[int] = None  # parallel KV eviction: tokens kept per chunk (paper: 2000); None = off
    score_window: int = 8  # last query tokens whose attention is accumulated (paper: 8)
    calibration_threshold: Optional[float] = None  # λ on mean attention probability; None = off
    bias_window: int = 200  # sink = first, recency = last tokens of a chunk (paper: 200)
    calibration_layers: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(PAPER_CALIBRATION_LAYERS))
    pretraining_length: Optional[int] = None  # None: the model's original context

    def __post_init__(self) -> None:
        for name in ("keep_chunks", "batch_chunks", "score_window", "bias_window"):
            check_int(name, getattr(self, name), "parallelcomp")
        for name in ("chunk_size", "kv_budget", "pretraining_length"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), "parallelcomp")
        tau = self.self_information_threshold
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0):
            raise ValueError(f"parallelcomp: self_information_threshold={tau!r} must be a number >= 0 or None")
        if self.calibration_threshold is not None and not self.calibration_threshold > 0:
            raise ValueError(f"parallelcomp: calibration_threshold={self.calibration_threshold!r} must be > 0 or None")
        unknown = sorted(set(self.calibration_layers) - {"sink", "middle", "recency"})
        if unknown:
            raise ValueError(f"parallelcomp: calibration_layers has {unknown}; allowed regions: sink, middle, recency")


# --- pieces with one job each (tested on their own) ----------------------------------------
def split_chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``0..n`` exactly, in order, each at most ``chunk_size``."""
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def keep_lowest(scored: Iterable[tuple[float, int, Any]], k: int) -> list[tuple[float, int, Any]]:
    """The ``k`` items with the lowest score from a stream of ``(score, index, payload)``,
    holding at most ``k`` at a time: a heap whose root is the worst kept item (highest
    score; on ties the later index). Returned in index order, the chunks' context order."""
    heap: list[tuple[float, int, Any]] = []  # (-score, -index, payload); indices are distinct
    for score, index, payload in scored:
        item = (-float(score), -index, payload)
        if len(heap) < k:
            heapq.heappush(heap, item)
        elif item[:2] > heap[0][:2]:  # lower score, or the same score and an earlier index
            heapq.heapreplace(heap, item)
    return sorted(((-s, -i, p) for s, i, p in heap), key=lambda t: t[1])


def region_of(layer: int, num_layers: int, layers: dict[str, tuple[float, float]]) -> Optional[str]:
    depth = layer / num_layers
    for region, (lo, hi) in layers.items():
        if lo <= depth < hi or (hi >= 1.0 and depth >= lo):
            return region
    return None


def evict(
    attention: torch.Tensor, *, kv_budget: Optional[int], threshold: Optional[float], region: Optional[str],
    bias_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens of one chunk one layer keeps, per KV head, from their cumulative
    attention (Hkv, n): ``index`` (Hkv, n') of the tokens kept by compression (the
    ``kv_budget`` highest, in position order: gathered, so memory shrinks) and ``keep``
    (Hkv, n') False where calibration evicts (a count that differs per head: masked)."""
    hkv, n = attention.shape
    pos = torch.arange(n, device=attention.device)
    keep = torch.ones(hkv, n, dtype=torch.bool, device=attention.device)
    if threshold is not None and region is not None:  # calibration: drop the bias tokens
        sink, recency = pos < bias_window, pos >= n - bias_window
        where = {"sink": sink, "recency": recency, "middle": ~sink & ~recency}[region]
        keep &= ~(where & (attention > threshold))
    index = pos.expand(hkv, n)
    if kv_budget is not None and n > kv_budget:  # compression: drop the low-attention tokens
        index = attention.topk(kv_budget, dim=-1).indices.sort(dim=-1).values
        keep = keep.gather(1, index)
    return index, keep


# --- the attention the model runs with while ParallelComp drives it, one method per phase -----
def _masked_attention(query, key, value, *, visible, scale) -> torch.Tensor:
    """SDPA of q (B,H,Nq,D) over k/v (B,Hkv,Nk,D) where ``visible`` (B,Hkv,Nq,Nk) allows."""
    groups = query.shape[1] // key.shape[1]
    mask = visible.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=scale
    )


def _causal(query, key) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B,Hkv,Nq,Nk) causal visibility of the last Nq of Nk positions, and the rows/columns."""
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    rows = torch.arange(nk - nq, nk, device=query.device)
    cols = torch.arange(nk, device=query.device)
    return (cols[None, :] <= rows[:, None]).expand(b, key.shape[1], nq, nk), rows, cols


class _Encode(Method):
    """Phase 1: causal attention over left-padded ``[chunk, query]`` rows that also records
    the mean attention probability the last ``score_window`` rows pay each key (eq. 5)."""

    name = "parallelcomp (encoding)"

    def __init__(self, score_window: int) -> None:
        self.score_window = score_window
        self.recorded: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
        hkv, nk, nq = key.shape[1], key.shape[2], query.shape[2]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        visible, rows, cols = _causal(query, key)
        if attention_mask is not None:  # left padding: pads see only themselves
            real = attention_mask[:, -nk:].bool()[:, None, None, :]
            visible = visible & real | (cols[None, :] == rows[:, None])
        out = _masked_attention(query, key, value, visible=visible, scale=scale)
        last, groups = min(self.score_window, nq), query.shape[1] // hkv
        scores = torch.einsum("bhid,bhjd->bhij", query[:, :, -last:].float(), key.float().repeat_interleave(groups, 1)) * scale
        probs = scores.masked_fill(~visible[:, :, -last:].repeat_interleave(groups, dim=1), float("-inf")).softmax(-1)
        self.recorded[module.layer_idx] = probs.mean(2).unflatten(1, (hkv, groups)).mean(2)  # (B,Hkv,Nk)
        return out.transpose(1, 2).contiguous(), None


class _Global(Method):
    """Phase 2: the query and generated tokens attend to the kept chunks' KV except evicted
    tokens (per KV head), then causally to themselves."""

    name = "parallelcomp (answering)"

    def __init__(self, keep: dict[int, torch.Tensor]) -> None:
        self.keep = keep  # layer -> (1, Hkv, S) over the kept chunks' tokens

    def __call__(self, module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        visible, _, _ = _causal(query, key)
        keep = self.keep[module.layer_idx]
        kept = torch.ones(*key.shape[:3], dtype=torch.bool, device=query.device)
        kept[:, :, : keep.shape[-1]] = keep
        out = _masked_attention(query, key, value, visible=visible & kept[:, :, None, :], scale=scale)
        return out.transpose(1, 2).contiguous(), None


# --- the method ------------------------------------------------------------------------------
@contextmanager
def _attending(model, method: Method) -> Iterator[None]:
    """The model attends with ``method`` inside the block, as before after it."""
    previous = current_method(model)
    install_method(model, method)
    try:
        yield
    finally:
        install_method(model, previous if previous is not None else ModelAttention())


def _encode(model, encoder: _Encode, *, spans, context, question, cfg, num_layers):
    """One parallel forward over ``[chunk, query]`` rows: per chunk its self-information and
    its per-layer (keys, values, keep mask) restricted to the chunk's tokens."""
    dev = model_device(model)
    wq = len(question)
    width = max(end - start for start, end in spans) + wq
    ids = torch.zeros(len(spans), width, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for row, (start, end) in enumerate(spans):
        ids[row, width - wq - (end - start) :] = torch.cat((context[start:end], question))
        mask[row, width - wq - (end - start) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    encoder.recorded = {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=wq + 1)
    logp = out.logits[:, :-1].float().log_softmax(-1)  # predicts the wq query tokens
    info = -logp.gather(-1, question.expand(len(spans), wq).unsqueeze(-1)).squeeze(-1).sum(-1)
    cache = out.past_key_values
    results = []
    for row, (start, end) in enumerate(spans):
        first, last = width - wq - (end - start), width - wq
        layers = []
        for layer in range(num_layers):
            k, v = _layer_kv(cache, layer)
            attention = encoder.recorded[layer][row, :, first:last]
            region = region_of(layer, num_layers, cfg.calibration_layers)
            index, keep = evict(attention, kv_budget=cfg.kv_budget, threshold=cfg.calibration_threshold, region=region,
                                bias_window=cfg.bias_window)
            index = index.unsqueeze(-1).expand(-1, -1, k.shape[-1])
            layers.append((k[row, :, first:last].gather(1, index), v[row, :, first:last].gather(1, index), keep))
        results.append((float(info[row]), end - start, layers))
    return results


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def select(model, context_ids: Sequence[int], question_ids: Sequence[int], cfg: ParallelCompConfig) -> list[tuple[float, int, Any]]:
    """Steps 1–4: the kept chunks as ``(self_information, chunk_index, (length, layers))``."""
    dev = model_device(model)
    context = torch.as_tensor(list(context_ids), dtype=torch.long, device=dev)
    question = torch.as_tensor(list(question_ids), dtype=torch.long, device=dev)
    config = pretrained(model).config
    pretraining = cfg.pretraining_length or rope.original_context(config)
    size = cfg.chunk_size or pretraining - len(question)
    if cfg.chunk_size is None and size < 1:
        raise ValueError(f"parallelcomp: the question ({len(question)} tokens) leaves no room for a context chunk "
                         f"within pretraining_length={pretraining}")
    if size < 1 or size + len(question) > pretraining:
        raise ValueError(
            f"parallelcomp: chunk_size={size} + question length {len(question)} must fit pretraining_length={pretraining}"
        )
    if len(context) == 0:
        raise ValueError("parallelcomp: context_ids is empty; there is nothing to select from")
    spans = split_chunks(len(context), size)
    num_layers = config.num_hidden_layers

    tau = cfg.self_information_threshold
    best: list[tuple[float, int, Any]] = []  # with τ: the most relevant chunk, whatever τ says

    encoder = _Encode(cfg.score_window)

    def stream():
        for lo in range(0, len(spans), cfg.batch_chunks):
            batch = spans[lo : lo + cfg.batch_chunks]
            encoded = _encode(model, encoder, spans=batch, context=context, question=question, cfg=cfg, num_layers=num_layers)
            for offset, (info, length, layers) in enumerate(encoded):
                item = (info, lo + offset, (length, layers))
                if tau is None or info <= tau:
                    yield item
                else:
                    best[:] = keep_lowest(best + [item], 1)

    # when no chunk passes τ the question is still answered from the most relevant one
    # (then every chunk was rejected, so ``best`` saw them all), never from no context
    with _attending(model, encoder):
        return keep_lowest(stream(), cfg.keep_chunks) or best


def generate(
    model, tokenizer, *, context_ids: Sequence[int], question_ids: Sequence[int], max_new_tokens: int, **params: Any
) -> list[int]:
    """Greedy answer to ``question_ids`` about ``context_ids`` (one sequence); returns the new
    token ids. ``params`` are :class:`ParallelCompConfig` fields."""
    from transformers import DynamicCache

    cfg = params.pop("config", None) or ParallelCompConfig(**params)
    if len(question_ids) == 0:
        raise ValueError("parallelcomp: question_ids is empty; the method ranks chunks by the query, so it needs one")
    kept = select(model, context_ids, question_ids, cfg)
    cache, keep = DynamicCache(), {}
    for layer in range(pretrained(model).config.num_hidden_layers):
        keys = torch.cat([layers[layer][0] for _, _, (_, layers) in kept], dim=1)[None]
        values = torch.cat([layers[layer][1] for _, _, (_, layers) in kept], dim=1)[None]
        keep[layer] = torch.cat([layers[layer][2] for _, _, (_, layers) in kept], dim=1)[None]
        cache.update(keys, values, layer)
    position = max(length for _, _, (length, _) in kept)  # the query follows the longest kept chunk
    dev = model_device(model)

    def next_logits(token: Optional[int]) -> torch.Tensor:
        nonlocal cache, position
        ids = torch.as_tensor([list(question_ids) if token is None else [token]], dtype=torch.long, device=dev)
        positions = torch.arange(position, position + ids.shape[1], device=dev)[None]
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache, position = out.past_key_values, position + ids.shape[1]
        return out.logits[0, -1]

    with _attending(model, _Global(keep)):
        return greedy(next_logits, max_new_tokens, tokenizer.eos_token_id if tokenizer is not None else None)


@register
class ParallelComp(Method):
    """``--method parallelcomp``: passkey answers through :func:`generate`; ``eval ppl``
    refuses with :data:`PPL_UNSUPPORTED`. Its parameters are :class:`ParallelCompConfig`'s."""

    name = "parallelcomp"
    supports = Supports(training=False, ppl=False, no_ppl_reason=PPL_UNSUPPORTED, kv_cache=True, padding=("left",))
    replaces_attention = False  # it switches the model per phase itself
    __signature__ = inspect.signature(ParallelCompConfig)

    def __init__(self, **params: Any) -> None:
        self.config = ParallelCompConfig(**params)

    def max_length(self, config: Any) -> Optional[int]:
        """None: chunks reuse positions, so the context may be any length."""
        return None

    def generate(self, model, tokenizer, *, context_ids, question_ids, max_new_tokens) -> list[int]:
        return generate(model, tokenizer, context_ids=context_ids, question_ids=question_ids,
                        max_new_tokens=max_new_tokens, config=self.config)
