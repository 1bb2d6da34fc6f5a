"""Tokens/s and peak memory of a training step (forward + backward through the whole model)
for each pattern against full attention, on a small Llama built from a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from tqdm import tqdm

from sparse_ft.attention import use_attention
from sparse_ft.bench.machine import measure
from sparse_ft.tiny import tiny_llama

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


@dataclass
class StepRow:
    pattern: str
    seq_len: int
    ms: float
    tokens_per_s: float
    full_tokens_per_s: float
    speedup: float
    peak_mib: float
    full_peak_mib: float


def run(lengths: Iterable[int], patterns: Iterable[str], device: str = "cpu", dtype: str = "fp32",
        warmup: int = 1, repeats: int = 3) -> list[StepRow]:
    dev = torch.device(device)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    rows: list[StepRow] = []
    lengths, patterns = list(lengths), ["full", *[p for p in patterns if p != "full"]]
    bar = tqdm(total=len(lengths) * len(patterns), desc="bench train", unit="run")
    for n in lengths:
        model = tiny_llama(max_position_embeddings=n, **MODEL).to(dev, torch_dtype).train()
        ids = torch.randint(3, 380, (1, n), device=dev)

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        base_ms = base_mib = None
        for name in patterns:
            use_attention(model, name)
            ms, mib = measure(step, dev, warmup, repeats)
            if name == "full":
                base_ms, base_mib = ms, mib
            rows.append(StepRow(name, n, ms, n / ms * 1e3, n / base_ms * 1e3, base_ms / ms, mib, base_mib))
            bar.update()
    bar.close()
    return rows


def markdown(rows: list[StepRow]) -> str:
    lines = ["| pattern | N | ms/step | tokens/s | full tokens/s | speedup | peak MiB | full peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.pattern} | {r.seq_len} | {r.ms:.0f} | {r.tokens_per_s:.0f} | {r.full_tokens_per_s:.0f} | "
                     f"{r.speedup:.2f}× | {r.peak_mib:.0f} | {r.full_peak_mib:.0f} |")
    return "\n".join(lines)


def as_dicts(rows: list[StepRow]) -> list[dict]:
    return [asdict(r) for r in rows]
