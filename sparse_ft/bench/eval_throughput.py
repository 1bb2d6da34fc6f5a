"""Sliding-window perplexity throughput of a 4-bit NF4 model against the same model in bf16
(or fp32 on CPU), both loaded through ``sparse-ft eval``'s own path
(``sparse_ft.evaluation.loading.load``) from one checkpoint with random weights, and scored by
its own ``evaluate_length``. Random weights give a perplexity near the vocabulary size; the
two perplexities only show that the quantised model computes nearly the same thing. Layers
bitsandbytes cannot quantise on the device stay unquantised and each row lists them, so a ratio
measured on a partly quantised model says so."""

from __future__ import annotations

import tempfile
from typing import Iterable, Iterator

import numpy as np
import torch

from sparse_ft import methods
from sparse_ft.bench import models
from sparse_ft.bench.machine import bench_dtype, cell, interleaved
from sparse_ft.evaluation import loading
from sparse_ft.evaluation.window_perplexity import evaluate_length
from sparse_ft.modeling.dtypes import SHORT_NAMES
from sparse_ft.modeling.quantization import unquantised_layers

KINDS = ("unquantised", "nf4")


def _load(path: str, dtype: str, device: str, nf4: bool):
    model, _ = loading.load(path, dtype=SHORT_NAMES[dtype], load_in_4bit=nf4, compute_dtype=SHORT_NAMES[dtype],
                            device=device, tokenizer=False)
    return model


def run(lengths: Iterable[int], model: str = "tiny", dtype: str = "fp32", device: str = "cpu", *, warmup: int = 1,
        repeats: int = 3) -> Iterator[dict]:
    """One row per length: tokens/s of one window of that length (fastest of alternating
    runs), each model's weight footprint and the peak memory growth of one window."""
    dev = torch.device(device)
    lengths = list(lengths)
    full = methods.get("full")
    with tempfile.TemporaryDirectory(prefix="sparse-ft-bench-eval-") as path:
        base = models.build(model, max(lengths), dev, bench_dtype(dtype))
        base.save_pretrained(path)
        del base
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        loaded = {kind: _load(path, dtype, str(dev), kind == "nf4") for kind in KINDS}
    kept = unquantised_layers(loaded["nf4"])  # the output head, and any layer bitsandbytes refuses here
    rng = np.random.default_rng(0)
    for n in lengths:
        tokens = rng.integers(0, models.vocab_size(model), n, dtype=np.int64)  # one window of n
        ppl: dict[str, float] = {}

        def window(kind: str):
            return lambda: ppl.__setitem__(kind,
                                           evaluate_length(loaded[kind], tokens, n, n, scoring="standard",
                                           method=full)["ppl"])

        got = interleaved({kind: window(kind) for kind in KINDS}, dev, warmup, repeats)
        row: dict = {"seq_len": n, "nf4_unquantised_layers": kept}
        for kind in KINDS:
            ms, mib = got[kind].min_ms, got[kind].peak_mib
            row.update({f"{kind}_tokens_per_s": n / ms * 1e3 if ms else None, f"{kind}_peak_mib": mib,
                        f"{kind}_weights_mib": loaded[kind].get_memory_footprint() / 2**20, f"{kind}_ppl": ppl.get(kind)})
        a, b = row["nf4_tokens_per_s"], row["unquantised_tokens_per_s"]
        row["nf4_ratio"] = a / b if a and b else None
        yield row


def markdown(rows: list[dict], dtype: str) -> str:
    table = [f"| N | {dtype} tokens/s | NF4 tokens/s | NF4 / {dtype} | {dtype} weights MiB | NF4 weights MiB | "
             f"{dtype} peak MiB | NF4 peak MiB | {dtype} ppl | NF4 ppl | layers left {dtype} |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        u, q = (lambda key: r[f"unquantised_{key}"]), (lambda key: r[f"nf4_{key}"])
        table.append(f"| {r['seq_len']} | {cell(u('tokens_per_s'), '.0f')} | {cell(q('tokens_per_s'), '.0f')} | "
                     f"{cell(r['nf4_ratio'], '.2f', '–')} | {u('weights_mib'):.0f} | {q('weights_mib'):.0f} | "
                     f"{cell(u('peak_mib'), '.0f')} | {cell(q('peak_mib'), '.0f')} | {cell(u('ppl'), '.1f', '–')} | "
                     f"{cell(q('ppl'), '.1f', '–')} | {len(r['nf4_unquantised_layers'])} |")
    return "\n".join(table)
