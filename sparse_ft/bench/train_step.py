"""Tokens/s and peak memory of a training step for each pattern against full attention, on a
Llama built from a config (``sparse_ft.bench.models``), trained the way a recipe trains it:
LoRA+ from the recipe defaults (r=8 on q/k/v/o, embeddings and norms trainable) through
``sparse_ft.train.model_setup.add_adapters``, optionally with gradient checkpointing.

A step is forward + backward (the optimizer update of the adapters costs the same for every
pattern). A size that runs out of GPU memory is recorded as OOM and the sweep goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from tqdm import tqdm

from sparse_ft import methods
from sparse_ft.modeling.attention import use_attention
from sparse_ft.bench import models
from sparse_ft.bench.machine import DTYPE_NAMES, DTYPES, cell, measure
from sparse_ft.config import LoraSection
from sparse_ft.train.model_setup import add_adapters


@dataclass
class StepRow:
    pattern: str
    seq_len: int
    ms: Optional[float]  # None: out of memory
    tokens_per_s: Optional[float]
    full_tokens_per_s: Optional[float]
    speedup: Optional[float]
    peak_mib: Optional[float]
    full_peak_mib: Optional[float]


def trained_methods(patterns: Iterable[str], backend: Optional[str], dtype: str) -> dict[str, methods.Method]:
    """``full`` (the model's own attention, the baseline a user would train with) first, then
    each pattern on ``backend``, built as a recipe builds them (bad names, and a backend a
    pattern cannot run, fail here, before any model is built)."""
    chosen = {"full": methods.for_training("full", {}, None, DTYPE_NAMES[dtype])[0]}
    for name in patterns:
        if name != "full":
            chosen[name] = methods.for_training(name, {}, backend, DTYPE_NAMES[dtype])[0]
    return chosen


def run(lengths: Iterable[int], patterns: Iterable[str], device: str = "cpu", dtype: str = "fp32",
        *, warmup: int = 1, repeats: int = 3, model: str = "tiny", gradient_checkpointing: bool = False,
        backend: Optional[str] = None) -> Iterator[StepRow]:
    dev = torch.device(device)
    lengths = list(lengths)
    chosen = trained_methods(patterns, backend, dtype)
    net = models.build(model, max(lengths), dev, DTYPES[dtype])
    net = add_adapters(net, LoraSection(), chosen["full"], gradient_checkpointing).train()
    vocab = models.vocab_size(model)
    bar = tqdm(total=len(lengths) * len(chosen), desc="bench train", unit="run")
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), device=dev, generator=torch.Generator(device=dev).manual_seed(n))

        def step():
            net.zero_grad(set_to_none=True)
            net(input_ids=ids, labels=ids).loss.backward()

        full = None
        for name, method in chosen.items():
            use_attention(net, method)
            measured = measure(step, dev, warmup, repeats)
            net.zero_grad(set_to_none=True)
            if name == "full":
                full = measured
            bar.update()
            yield _row(name, n, measured, full)
    bar.close()


def _row(name: str, n: int, measured: Optional[tuple[float, float]], full: Optional[tuple[float, float]]) -> StepRow:
    ms, mib = measured or (None, None)
    full_ms, full_mib = full or (None, None)
    per_s = lambda t: None if t is None else n / t * 1e3  # noqa: E731
    speedup = full_ms / ms if ms and full_ms else None
    return StepRow(name, n, ms, per_s(ms), per_s(full_ms), speedup, mib, full_mib)


def markdown(rows: list[StepRow]) -> str:
    lines = ["| pattern | N | ms/step | tokens/s | full tokens/s | speedup | peak MiB | full peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.pattern} | {r.seq_len} | {cell(r.ms, '.0f')} | {cell(r.tokens_per_s, '.0f')} | "
                     f"{cell(r.full_tokens_per_s, '.0f')} | {cell(r.speedup, '.2f', '–', '×')} | {cell(r.peak_mib, '.0f')} | "
                     f"{cell(r.full_peak_mib, '.0f')} |")
    return "\n".join(lines)

