"""The memory planner (sparse_ft/plan): its arithmetic on cases known by other means, and one
measured step of the tiny model (scripts/plan_check.py measures more)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparse_ft.plan import memory
from sparse_ft.plan.geometry import KNOWN, model_shape
from sparse_ft.plan.memory import Setup

LLAMA2 = KNOWN["meta-llama/Llama-2-7b-hf"]
LLAMA3 = KNOWN["meta-llama/Llama-3.1-8B"]


def test_known_parameter_counts_match_the_model_cards():
    assert round(LLAMA2.params() / 1e9, 2) == 6.74
    assert round(LLAMA3.params() / 1e9, 2) == 8.03
    assert round(KNOWN["mistralai/Mistral-7B-v0.1"].params() / 1e9, 2) == 7.24
    assert round(KNOWN["Qwen/Qwen2.5-7B"].params() / 1e9, 2) == 7.62


def test_weights_of_a_7b_in_bf16_and_nf4():
    assert round(memory.weights(Setup(shape=LLAMA2))["weights"] / 1e9, 1) == 13.5
    nf4 = memory.weights(Setup(shape=LLAMA2, quantization="nf4"))["weights"]
    linear = LLAMA2.layers * LLAMA2.layer_linear_params()
    assert memory.NF4_BITS == pytest.approx(4.127, abs=1e-3)
    assert nf4 == pytest.approx(linear * 4.127 / 8 + (LLAMA2.params() - linear) * 2, rel=1e-4)
    zero3 = memory.weights(Setup(shape=LLAMA2, zero_stage=3, world_size=8))
    assert zero3["weights"] == pytest.approx(LLAMA2.params() * 2 / 8)
    assert zero3["weights gathered (ZeRO-3)"] == 2 * LLAMA2.layer_linear_params() * 2
    qlora3 = memory.weights(Setup(shape=LLAMA2, quantization="nf4", zero_stage=3, world_size=8))  # gathers packed NF4
    assert qlora3["weights"] == pytest.approx(nf4 / 8)
    assert qlora3["weights gathered (ZeRO-3)"] == pytest.approx(2 * LLAMA2.layer_linear_params() * 4.127 / 8, rel=1e-4)


def test_trainable_count_is_peft_s():
    """LoRA on q/k/v/o and LoRA+'s embeddings and norms, as the recipes train, on the tiny model."""
    from sparse_ft import methods
    from sparse_ft.config import LoraSection
    from sparse_ft.modeling.tiny import tiny_llama
    from sparse_ft.train.model_setup import add_adapters

    model = add_adapters(tiny_llama(), LoraSection(), methods.for_training("full", {}, None, "float32")[0], False)
    actual = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(memory.trainable_params(Setup(shape=model_shape("tiny"))).values()) == actual


def test_sparse_patterns_grow_linearly_and_the_math_kernel_does_not():
    for pattern in ("scca_flow", "s2", "longmixed", "sda", "full"):
        setup = Setup(shape=LLAMA3, pattern=pattern, offload_activations=True, mlp_tile_tokens=8192)
        a, b, c = (memory.peak(setup, n) for n in (65536, 131072, 196608))
        assert b - a == pytest.approx(c - b, rel=1e-9), pattern
    math = Setup(shape=LLAMA3, pattern="full", kernel="math")
    a, b, c = (memory.peak(math, n) for n in (65536, 131072, 196608))
    assert c - b > 1.5 * (b - a)


def test_longest_fit_is_monotone_and_tight():
    setup = Setup(shape=LLAMA3, zero_stage=3, offload_activations=True, mlp_tile_tokens=8192)
    fits = [memory.longest_fit(setup, gib * memory.GIB) for gib in (24, 40, 80, 141, 200)]
    assert fits[0] is None or all(f is not None for f in fits[1:])
    numbers = [f for f in fits if f is not None]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    budget = 80 * memory.GIB
    n = memory.longest_fit(setup, budget)
    assert memory.peak(setup, n) <= budget < memory.peak(setup, n + 1024)
    sp = memory.longest_fit(dataclasses.replace(setup, sequence_parallel=8, world_size=8), budget)
    assert sp > n and sp % 8 == 0


def test_each_feature_lowers_the_peak_at_long_context():
    plain = Setup(shape=LLAMA3, zero_stage=3, loss="model")
    n = 65536
    steps = [plain, dataclasses.replace(plain, loss="chunked"),
             dataclasses.replace(plain, loss="chunked", offload_activations=True),
             dataclasses.replace(plain, loss="chunked", offload_activations=True, mlp_tile_tokens=8192)]
    peaks = [memory.peak(s, n) for s in steps]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


def test_plan_command_writes_json_and_markdown(tmp_path, capsys):
    from sparse_ft.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "recipe=tiny", "--gpu-memory", "1GiB,2GB", "--sp", "1,2", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["sequence_parallel"] for r in data["longest_fit"][:2]] == [1, 2]
    assert out.with_suffix(".md").read_text().count("| scca_flow |") == 2
    assert "Predictions, not measurements" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--gpu-memory", "80 bananas"], "--gpu-memory '80 bananas' must be a positive size"),
    (["--sp", "0"], "--sp='0' must be a comma list of positive integers"),
    (["--sp", "2", "--gpus", "3"], "--gpus=3 must be a multiple of every --sp"),
])
def test_bad_plan_flags_are_one_line(argv, words, capsys):
    from sparse_ft.cli import main

    assert main(["plan", "recipe=tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_unknown_hub_model_is_refused_by_name():
    with pytest.raises(ValueError, match="model.name_or_path='someone/unknown-7b' has no shapes here"):
        model_shape("someone/unknown-7b")


def test_prediction_matches_a_measured_tiny_step():
    """One LoRA+ step of the tiny model with gradient checkpointing through scca_flow, long
    enough (4k) for the recomputed layer to be the peak: the
    bytes torch's CPU allocator holds at the step's peak (profiler memory events, as
    scripts/plan_check.py measures) against the planner's prediction."""
    import importlib.util

    from sparse_ft.config.paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("plan_check", REPO_ROOT / "scripts" / "plan_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    case = dict(model="tiny", layers=4, pattern="scca_flow", feature="ckpt", n=4096, device="cpu", dtype="float32")
    measured = check.measure_child(case)["step_mib"] * 2**20
    _, predicted = check.predicted(check.setup_for("tiny", 4, "scca_flow", "ckpt", dtype="float32", device="cpu"), 4096)
    assert predicted == pytest.approx(measured, rel=0.10)
