"""The training step cost of each variant row against its plain pattern's, measured in one
process with every option interleaved (``bench.machine.interleaved``: round-robin rounds, min
and median of the repeats).

Why not the rows' own step times: rows train one after another, in separate processes and
sometimes on separate days, and a machine's load and clock drift between them. In the
miniature's first variant run the plain rows had been timed a day earlier: every variant read
≥ 1.15× its plain pattern, a dense tail 1.19× where its two kinds of step predict 1.07×.
Interleaving exposes every option to the same drift, so the ratio is the options' own.

Each option is timed as its run trains: the base loaded and extended as the recipe says, LoRA+
from the recipe, the method ``train.py`` builds (``training_method``: the pattern with its
parameters and dense layers), one forward+backward of a ``model.target_length`` sequence. A
dense tail's run is the mean of its two kinds of step weighted by ``train.dense_final_fraction``
(its last steps attend fully in every layer, as the trainer switches them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from sparse_ft.config import Recipe

WARMUP, REPEATS = 1, 5


def measure(recipes: dict[str, "Recipe"], plain_of: dict[str, str], *, warmup: int = WARMUP,
            repeats: int = REPEATS) -> dict[str, dict]:
    """Per option of ``recipes`` (a row name without its seed: ``s2``, ``s2+sinks``), its step's
    min and median milliseconds and, for a variant (``plain_of`` names its plain option, which
    ``recipes`` holds), ``ratio``: its median over the plain option's, and ``ratio_min`` of the
    mins. One model serves every option: they differ in attention only, installed per step."""
    from sparse_ft.bench.machine import interleaved
    from sparse_ft.bench.train_step import weighted
    from sparse_ft.modeling.attention import install_method
    from sparse_ft.train.model_setup import base_model_path, build_model, training_method

    first = next(iter(recipes.values()))
    methods = {(name, False): training_method(recipe) for name, recipe in recipes.items()}
    tails = {name: r.train.dense_final_fraction for name, r in recipes.items() if r.train.dense_final_fraction}
    for name in tails:  # the tail's steps: every layer attends fully, as the trainer switches it
        methods[(name, True)] = training_method(recipes[name])
        methods[(name, True)].everywhere = True
    model = build_model(first, base_model_path(first), methods[(next(iter(recipes)), False)]).train()
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, first.seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    def step(method) -> Callable[[], None]:
        def run() -> None:
            install_method(model, method)
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    got = interleaved({key: step(method) for key, method in methods.items()}, device, warmup, repeats)
    out: dict[str, dict] = {}
    for name in recipes:
        t = weighted(got[(name, False)], got[(name, True)], tails[name]) if name in tails else got[(name, False)]
        out[name] = {"ms_min": t.min_ms, "ms_median": t.median_ms}
    for name, plain in plain_of.items():
        out[name]["ratio"] = _ratio(out[name]["ms_median"], out[plain]["ms_median"])
        out[name]["ratio_min"] = _ratio(out[name]["ms_min"], out[plain]["ms_min"])
    return out


def _ratio(mine: Optional[float], plain: Optional[float]) -> Optional[float]:
    return None if mine is None or not plain else mine / plain

