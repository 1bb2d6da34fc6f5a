"""Effective context length (RULER, Hsieh et al. 2024): the longest evaluated length whose
mean score over the tasks run clears a threshold.

Two thresholds are reported. RULER's is absolute: 85.6, Llama-2-7B's mean at 4K, its
pretraining length (the paper's "qualitative threshold"; RULER's table counts a tie as
clearing: Qwen3-32B's 85.6 at 128K is underlined). Ours is relative, for models far from
Llama-2's scale (the tiny base scores nowhere near 85.6 at any length): a fraction of the
base model's own mean at its pretraining length, so "effective" means "keeps that share of
what the model does inside its context". Pure numbers; the suite in
``sparse_ft.evaluation.tasks.ruler`` measures them.
"""

from __future__ import annotations

from statistics import mean
from typing import Optional

RULER_THRESHOLD = 85.6


def means_by_length(rows: list[dict]) -> dict[int, float]:
    """Per length, the mean of its rows' ``score`` (one row per task and length)."""
    scores: dict[int, list[float]] = {}
    for row in rows:
        scores.setdefault(row["length"], []).append(row["score"])
    return {length: mean(values) for length, values in sorted(scores.items())}


def effective_length(means: dict[int, float], threshold: float) -> Optional[int]:
    """The longest length whose mean is at least ``threshold``; None when none is."""
    passing = [length for length, score in means.items() if score >= threshold]
    return max(passing) if passing else None


def summarise(means: dict[int, float], *, threshold: float = RULER_THRESHOLD, fraction: float,
              base_mean: Optional[float], note: str = "no base measurement") -> dict:
    """Both effective lengths. ``base_mean``: the base model's mean at its pretraining length,
    or None (then the relative one is None and ``note`` says why). A length that is the
    longest evaluated says so (``longest_evaluated``): the model may hold further."""
    longest = max(means) if means else None

    def result(limit: Optional[float]) -> dict:
        found = None if limit is None else effective_length(means, limit)
        return {"threshold": limit, "length": found, "longest_evaluated": found is not None and found == longest}

    if base_mean is not None and base_mean <= 0:
        base_mean, note = None, "the base scores 0 at its pretraining length"
    relative = result(None if base_mean is None else fraction * base_mean)
    return {"ruler": result(threshold),
            "relative": {"fraction": fraction, **relative, "note": None if base_mean is not None else note}}


def brief(found: dict) -> str:
    """One effective length in a few characters: ``2048``, ``≥4096``, ``none``, ``n/a``."""
    if found["threshold"] is None:
        return "n/a"
    if found["length"] is None:
        return "none"
    return f"≥{found['length']}" if found["longest_evaluated"] else str(found["length"])


def describe(found: dict) -> str:
    """One effective length for a markdown line: ``2048``, ``>= 4096 (the longest evaluated)``, ``none``."""
    if found["length"] is None:
        return "none (no length clears it)"
    return f">= {found['length']} (the longest evaluated)" if found["longest_evaluated"] else str(found["length"])
