"""Sliding-window perplexity at one length: the windows of :mod:`windows`, scored by
:func:`scoring.window_nll`, batched, under inference mode; only sums survive a batch."""

from __future__ import annotations

import math
import time
from itertools import groupby
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from sparse_ft import console
from sparse_ft.methods import Method
from sparse_ft.evaluation.scoring import window_nll
from sparse_ft.evaluation.windows import plan


def evaluate_length(model, tokens: np.ndarray, length: int, stride: int, *, scoring: str, method: Method,
                    batch_size: int = 1, max_windows: Optional[int] = None) -> dict:
    """``{"length", "ppl", "tokens" (scored), "windows", "seconds", "tokens_per_second"}``."""
    if length > len(tokens):
        raise ValueError(f"--lengths {length} is longer than the {len(tokens)} tokens of --data (lower it or add data)")
    method.apply(model, length)
    windows = plan(len(tokens), length, stride, scoring, max_windows=max_windows)
    device = next(model.parameters()).device
    nll_sum, count, window_means = 0.0, 0, []
    began = time.perf_counter()
    bar = tqdm(total=len(windows), desc=console.bar_label(f"ppl @ {length}"), unit="window", leave=False)
    # windows of equal shape share a batch (only the last standard window can be shorter)
    for _, group in groupby(windows, key=lambda w: (w.end - w.begin, w.first - w.begin, w.last - w.begin)):
        group = list(group)
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            w0 = batch[0]
            inputs = torch.from_numpy(np.stack([np.asarray(tokens[w.begin : w.end], dtype=np.int64) for w in batch])).to(device)
            targets = torch.from_numpy(np.stack([np.asarray(tokens[w.first + 1 : w.last + 1], dtype=np.int64) for w in batch])).to(device)
            nll = window_nll(model, inputs, targets, w0.first - w0.begin, last=w0.last - w0.begin)
            nll_sum += float(nll.sum(dtype=torch.float64))
            count += nll.numel()
            window_means.extend(nll.double().mean(dim=1).tolist())
            bar.update(len(batch))
    bar.close()
    seconds = time.perf_counter() - began
    ppl = math.exp(nll_sum / count) if scoring == "standard" else math.exp(sum(window_means) / len(window_means))
    return {"length": length, "ppl": ppl, "tokens": count, "windows": len(windows), "seconds": seconds,
            "tokens_per_second": sum(w.end - w.begin for w in windows) / seconds}
