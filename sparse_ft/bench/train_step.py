"""Tokens/s and peak memory of a training step for each pattern against full attention, on a
Llama built from a config (``sparse_ft.bench.models``), trained the way a recipe trains it:
LoRA+ from the recipe defaults (r=8 on q/k/v/o, embeddings and norms trainable) through
``sparse_ft.train.model_setup.add_adapters``, optionally with gradient checkpointing.

A step is forward + backward (the optimizer update of the adapters costs the same for every
pattern). Full attention, attention replaced by a no-op, and each pattern run round-robin,
min and median of ``repeats``. A size that runs out of GPU memory is recorded as OOM and the
sweep goes on.

How much a pattern can speed the step up is bounded by attention's share ``a`` of the full-
attention step (Amdahl): a pattern at its ideal (causal pairs ÷ its pairs) gives at most
``1 / ((1 − a) + a / ideal)``, and each row prints its measured speedup's fraction of that bound.
``a = 1 − t(no-op) / t(full)``, timing the step with attention replaced by :class:`NoAttention`
(same output shape, q, k and v kept in the graph). We measure it so rather than summing the
attention kernels of a profiled step because (1) it times the real step, without the
profiler's overhead, which inflates short kernels and launch gaps unevenly; (2) it charges
attention with all it costs: K/V expansion for GQA, layout copies, its recomputation under
gradient checkpointing, launch gaps a kernel filter does not see; (3) it is exactly what the
bound asks, the step's time if attention were free; (4) it means the same on a CPU and a GPU.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from tqdm import tqdm

import attn_patterns
from sparse_ft import methods
from sparse_ft.methods.dense_layers import DenseSpec, dense_layers_name
from sparse_ft.modeling.attention import IMPLEMENTATION, install_method, pretrained
from sparse_ft.bench import models
from sparse_ft.bench.attention import sinks_name
from sparse_ft.bench.machine import CallPeak, Timing, bench_dtype, cell, interleaved, ratio
from sparse_ft.config import LoraSection
from sparse_ft.modeling.dtypes import SHORT_NAMES
from sparse_ft.train.model_setup import add_adapters

NO_ATTENTION = "no attention"
# What the two memory columns measure, for the report.
PEAK_MEMORY = {
    "step": "peak allocated during the whole step (forward+backward) above the model's weights: activations, "
            "gradients, workspace (CUDA: torch.cuda.max_memory_allocated; CPU: resident high-water mark, VmHWM)",
    "attention": "the attention call's own peak above what was allocated when it began, the largest over the "
                 "step's calls (every layer, and recomputation under gradient checkpointing); CUDA only, n/a on CPU",
}


@dataclass
class StepRow:
    pattern: str
    seq_len: int
    ms_min: Optional[float]  # None: failed (out of memory), ``error`` says so
    ms_median: Optional[float]
    tokens_per_s: Optional[float]  # at the median
    full_tokens_per_s: Optional[float]
    speedup: Optional[float]  # of the medians
    speedup_min: Optional[float]  # of the mins
    ideal: Optional[float]  # causal pairs / pattern pairs (None for no attention: unbounded)
    attention_share: Optional[float]  # a, of the full-attention step at this length
    amdahl_bound: Optional[float]
    fraction_of_bound: Optional[float]
    step_peak_mib: Optional[float]  # PEAK_MEMORY["step"]
    attention_peak_mib: Optional[float]  # PEAK_MEMORY["attention"]
    error: Optional[str] = None


class NoAttention:
    """Attention replaced by a no-op of equal shapes: the output is the query (as transformers
    lays an attention output out), with key and value added in times zero so that their
    projections' backward runs as under real attention. O(N·H·D) work, no scores."""

    name = NO_ATTENTION
    replaces_attention = True

    def check_model(self, config: Any) -> None:
        """Any model takes it: it computes nothing."""

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
        tied = (key.sum() + value.sum()) * 0
        return (query + tied).transpose(1, 2).contiguous(), None


def amdahl_bound(share: float, ideal: float) -> float:
    """The most a step can speed up when attention, ``share`` of it, runs ``ideal`` times
    faster: 1 / ((1 − a) + a / ideal). ``ideal = inf``: attention free."""
    return 1 / ((1 - share) + share / ideal)


def trained_methods(patterns: Iterable[str], backend: Optional[str], dtype: str, *,
                    dense_layers: DenseSpec = (), dense_tail: bool = False,
                    sink_tokens: int = 0) -> dict[str, methods.Method]:
    """``full`` (the model's own attention, the baseline a user would train with) first, then
    each pattern on ``backend``, built as a recipe builds them (bad names, and a backend a
    pattern cannot run, fail here, before any model is built); with ``sink_tokens`` each
    pattern also with that many sink tokens (:func:`sinks_name`), as a recipe's
    ``attention.params.sink_tokens`` trains (plain patterns only: no sinks with dense layers or
    a dense tail); with ``dense_layers`` each pattern also with those layers attending fully
    (:func:`dense_layers_name`), as a recipe's ``attention.dense_layers`` trains; with
    ``dense_tail`` the all-dense step (:data:`DENSE`), which a dense tail takes."""
    chosen = {"full": methods.for_training("full", {}, None, SHORT_NAMES[dtype])[0]}
    for name in patterns:
        if name != "full":
            chosen[name] = methods.for_training(name, {}, backend, SHORT_NAMES[dtype])[0]
            if sink_tokens:
                with_sinks = {"sink_tokens": sink_tokens}
                chosen[sinks_name(name, sink_tokens)] = methods.for_training(name, with_sinks, backend, SHORT_NAMES[dtype])[0]
            if dense_layers:
                chosen[dense_layers_name(name, dense_layers)] = methods.with_dense_layers(chosen[name], dense_layers)
    if dense_tail:
        chosen[DENSE] = methods.for_training(DENSE, {}, backend, SHORT_NAMES[dtype])[0]
    return chosen


DENSE = "causal"  # a dense tail's step: full attention in every layer on the patterns' kernels


def dense_tail_name(pattern: str, fraction: float) -> str:
    """The row of ``pattern``'s run whose last ``fraction`` of steps attend fully."""
    return f"{pattern}, dense tail {fraction:g}"


def visible_pairs(method: methods.Method, n: int, heads: int, layers: int) -> float:
    """The (query, key) pairs one layer of ``method`` attends on average: a pattern's, or with
    dense layers the mean over the model's ``layers`` layers."""
    if isinstance(method, methods.DenseLayers):
        full = len(methods.dense_layer_indices(method.layers, layers))
        mean = (layers - full) * visible_pairs(method.method, n, heads, layers) + full * visible_pairs(method.dense, n, heads, layers)
        return mean / layers
    return method.pattern.visible_pairs(n, heads)


def _registered(name: str, *args: Any, **kwargs: Any) -> Any:
    from transformers import AttentionInterface

    return AttentionInterface()[name](*args, **kwargs)  # a fresh interface: the registered function


@contextmanager
def _attention_through(net: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Every attention call of ``net`` through ``wrap``: its own implementation (full attention)
    and the one sparse_ft installs, overridden where transformers looks them up per call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = [name for name in (pretrained(net).config._attn_implementation, IMPLEMENTATION) if name != "eager"]
    for name in names:
        ALL_ATTENTION_FUNCTIONS[name] = wrap(functools.partial(_registered, name))
    try:
        yield
    finally:
        for name in names:
            del ALL_ATTENTION_FUNCTIONS[name]


def run(lengths: Iterable[int], patterns: Iterable[str], device: str = "cpu", dtype: str = "fp32",
        *, warmup: int = 1, repeats: int = 3, model: str = "tiny", gradient_checkpointing: bool = False,
        backend: Optional[str] = None, dense_layers: DenseSpec = (),
        dense_final_fraction: float = 0.0, sink_tokens: int = 0) -> Iterator[StepRow]:
    """Rows of one length come together, after its last round (round-robin needs them all).
    ``dense_layers`` and ``dense_final_fraction`` as a recipe's: each pattern's step is also
    measured with those layers attending fully, and a dense tail's all-dense step too, whose
    rows (:func:`dense_tail_name`) are the steps' mean weighted by the fractions of a run each
    takes, from the two measurements. ``sink_tokens`` as ``attention.params.sink_tokens``: each
    pattern's step also measured with that many sink tokens, its ideal over its own pairs."""
    dev = torch.device(device)
    lengths = list(lengths)
    patterns = [p for p in patterns if p != "full"]
    chosen = trained_methods(patterns, backend, dtype, dense_layers=dense_layers, dense_tail=dense_final_fraction > 0,
                             sink_tokens=sink_tokens)
    net = models.build(model, max(lengths), dev, bench_dtype(dtype))
    net = add_adapters(net, LoraSection(), chosen["full"], gradient_checkpointing).train()
    vocab, shape = models.vocab_size(model), models.config(model, max(lengths))
    heads, layers = shape.num_attention_heads, shape.num_hidden_layers
    runs = {"full": chosen.pop("full"), NO_ATTENTION: NoAttention(), **chosen}
    trained = [dense_layers_name(p, dense_layers) if dense_layers else p for p in patterns]  # what a run's steps take
    causal = attn_patterns.get("causal")
    own = CallPeak(dev)
    with _attention_through(net, own.wrap):
        for n in tqdm(lengths, desc="bench train", unit="length"):
            ids = torch.randint(0, vocab, (1, n), device=dev, generator=torch.Generator(device=dev).manual_seed(n))
            own_peaks: dict[str, Optional[float]] = {}

            def step(name: str, method) -> Callable[[], None]:
                def run_step() -> None:
                    install_method(net, method)
                    own.start()
                    net(input_ids=ids, labels=ids).loss.backward()
                    net.zero_grad(set_to_none=True)  # every run starts with the same memory held
                    own_peaks[name] = own.mib  # the last run of each is its peak-memory run

                return run_step

            got = interleaved({name: step(name, method) for name, method in runs.items()}, dev, warmup, repeats)
            full, free = got["full"], got[NO_ATTENTION]
            share = None if ratio(free.median_ms, full.median_ms) is None else 1 - free.median_ms / full.median_ms
            pairs = {name: visible_pairs(method, n, heads, layers) for name, method in runs.items()
                     if name not in ("full", NO_ATTENTION)}
            for name, method in runs.items():
                ideal = 1.0 if name == "full" else None if name == NO_ATTENTION else causal.visible_pairs(n, heads) / pairs[name]
                yield _row(name, n, got[name], full, share=share, ideal=ideal, attention_mib=own_peaks.get(name))
            for name in trained if dense_final_fraction else ():
                f = dense_final_fraction
                mean = weighted(got[name], got[DENSE], f)
                ideal = causal.visible_pairs(n, heads) / ((1 - f) * pairs[name] + f * pairs[DENSE])
                peaks = [own_peaks.get(name), own_peaks.get(DENSE)]
                yield _row(dense_tail_name(name, f), n, mean, full, share=share, ideal=ideal,
                           attention_mib=None if None in peaks else max(peaks))


def weighted(pattern: Timing, dense: Timing, fraction: float) -> Timing:
    """A run's mean step when ``fraction`` of its steps are ``dense`` and the rest ``pattern``:
    the times weighted, the peak memory the larger; failed where either failed."""
    error = pattern.error or dense.error
    if error is not None:
        return Timing(error=error)
    return Timing((1 - fraction) * pattern.min_ms + fraction * dense.min_ms,
                  (1 - fraction) * pattern.median_ms + fraction * dense.median_ms,
                  None if None in (pattern.peak_mib, dense.peak_mib) else max(pattern.peak_mib, dense.peak_mib))


def _row(name: str, n: int, mine: Timing, full: Timing, *, share: Optional[float], ideal: Optional[float],
         attention_mib: Optional[float]) -> StepRow:
    per_s = lambda t: None if t is None else n / t * 1e3  # noqa: E731
    speedup = ratio(full.median_ms, mine.median_ms)
    bound = None if share is None else amdahl_bound(share, math.inf if ideal is None else ideal)
    return StepRow(name, n, mine.min_ms, mine.median_ms, per_s(mine.median_ms), per_s(full.median_ms), speedup,
                   ratio(full.min_ms, mine.min_ms), ideal, share, bound, ratio(speedup, bound), mine.peak_mib,
                   attention_mib if mine.error is None else None, mine.error)


def markdown(rows: list[StepRow]) -> str:
    lines = ["| pattern | N | ms min | ms median | tokens/s | full tokens/s | speedup | speedup (mins) | ideal | "
             "attention share | Amdahl bound | of bound | step peak MiB | attention peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.pattern} | {r.seq_len} | {cell(r.ms_min, '.0f')} | {cell(r.ms_median, '.0f')} | "
                     f"{cell(r.tokens_per_s, '.0f')} | {cell(r.full_tokens_per_s, '.0f')} | "
                     f"{cell(r.speedup, '.2f', '–', '×')} | {cell(r.speedup_min, '.2f', '–', '×')} | "
                     f"{cell(r.ideal, '.2f', '∞', '×')} | {cell(r.attention_share, '.2f', '–')} | "
                     f"{cell(r.amdahl_bound, '.2f', '–', '×')} | {cell(r.fraction_of_bound, '.2f', '–')} | "
                     f"{cell(r.step_peak_mib, '.0f')} | {cell(r.attention_peak_mib, '.0f', 'n/a' if r.error is None else 'OOM')} |")
    return "\n".join(lines)
