"""The benchmarks run end to end on CPU at tiny sizes and write what scripts/gpu_bench.sh collects on
a GPU: JSON and a markdown table with the command, rows per size, OOM recorded, not fatal."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparse_ft.bench import cli as bench_cli
from sparse_ft.bench import machine, models, train_step
from sparse_ft.cli import main


def _oom():
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")


def test_bench_attention_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "attention", "--lengths", "64,96", "--heads", "8", "--kv-heads", "2", "--head-dims", "16",
                 "--repeats", "1", "--warmup", "0", "--backends", "sdpa", "--output", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["machine"] and payload["dtype"] == "fp32" and payload["device"] == "cpu"
    assert "torch threads" in payload["machine"] and "VmHWM" in payload["peak_memory"]
    assert payload["warmup"] == 0 and payload["repeats"] == 1 and payload["complete"] is True
    assert payload["command"].startswith("sparse-ft bench attention --lengths 64,96")
    rows = payload["results"]
    assert {r["pattern"] for r in rows} == {"s2", "scca_fixed", "scca_flow", "sda", "longmixed"}
    assert {r["seq_len"] for r in rows} == {64, 96} and {r["backend"] for r in rows} == {"sdpa"}
    for r in rows:
        assert (r["heads"], r["kv_heads"], r["head_dim"]) == (8, 2, 16)
        assert r["ms"] > 0 and r["dense_ms"] > 0
        assert abs(r["speedup"] - r["dense_ms"] / r["ms"]) < 1e-9
        assert abs(r["fraction_of_ideal"] - r["speedup"] / r["ideal"]) < 1e-9
        assert r["ideal"] > 1.0  # every sparse pattern computes fewer pairs than causal attention
        assert r["peak_mib"] == r["peak_mib"] and r["dense_peak_mib"] == r["dense_peak_mib"]  # measured, not NaN
    s2_64 = next(r for r in rows if r["pattern"] == "s2" and r["seq_len"] == 64)
    # N=64, w=16: 4 heads in chunks of 16 (4·136 pairs), 4 heads in 8|16|16|16|8 (36+3·136+36).
    assert s2_64["ideal"] == (8 * 64 * 65 / 2) / (4 * 4 * 136 + 4 * (36 + 3 * 136 + 36))
    assert "| scca_flow | sdpa | 64 |" in capsys.readouterr().out
    markdown = out.with_suffix(".md").read_text()
    assert f"Command: `{payload['command']}`" in markdown and "| longmixed | sdpa | 96 |" in markdown


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "attention", "--lengths", "64,x"]) == 2
    assert "comma-separated list of integers" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--patterns", "bogus"]) == 2
    assert "pattern='bogus' is unknown" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--kv-heads=3 must divide" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "6", "--patterns", "scca_flow"]) == 2
    assert "num_heads=6" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "sdpa,triton"]) == 2
    assert "bench attention: --backends='sdpa,triton' is not a comma list of sdpa, flex, flash" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "flex", "--device", "cpu"]) == 2
    assert "flex needs CUDA" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "flash", "--device", "cpu"]) == 2
    assert "flash needs the flash-attn package, CUDA" in capsys.readouterr().err
    assert main(["bench", "train", "--lengths", "64", "--backend", "flash", "--device", "cpu"]) == 2
    assert "bench train: --backend flash needs the flash-attn package" in capsys.readouterr().err
    assert main(["bench", "dca", "--lengths", "64", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--heads=8 must be a multiple of --kv-heads=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "train", "--model", "7b"])
    assert "invalid choice: '7b'" in capsys.readouterr().err


def test_bench_train_step_lora_with_checkpointing(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "32", "--patterns", "scca_flow", "--repeats", "1", "--warmup", "0",
                 "--model", "tiny", "--gradient-checkpointing", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["model"] == "tiny" and payload["gradient_checkpointing"] is True and payload["complete"] is True
    rows = payload["results"]
    assert [r["pattern"] for r in rows] == ["full", "scca_flow"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["tokens_per_s"] > 0
    assert "| scca_flow | 32 |" in capsys.readouterr().out
    assert "LoRA+" in out.with_suffix(".md").read_text()


def test_1b_model_is_the_issue_shape():
    """16 layers x 2048, 32 heads over 8 KV heads, Llama: built on the meta device, no memory."""
    from transformers import AutoModelForCausalLM

    config = models.config("1b", 32768)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.max_position_embeddings) == (16, 2048, 32, 8, 5632, 32768)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 0.8e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    with pytest.raises(ValueError, match="--model '7b' is unknown; allowed: tiny, 1b, 8b$"):
        models.config("7b", 8)


def test_8b_model_has_the_planners_llama31_shape():
    from sparse_ft.plan.geometry import KNOWN, from_config

    shape = from_config(models.config("8b", 8192), "8b")
    want = KNOWN["meta-llama/Llama-3.1-8B"]
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab) == (
        want.layers, want.hidden, want.heads, want.kv_heads, want.intermediate, want.vocab)


def test_out_of_memory_is_recorded_and_the_sweep_goes_on():
    cpu = torch.device("cpu")
    assert machine.measure(_oom, cpu, 1, 2) is None
    got = machine.interleaved({"dense": _oom, "dca": lambda: None}, cpu, 1, 2)
    assert got["dense"] is None and got["dca"][0] >= 0
    assert machine.cell(None, ".1f") == "OOM" and machine.cell(None, ".2f", "–", "×") == "–"


def test_bench_train_records_full_attention_oom(tmp_path, monkeypatch, capsys):
    """Full attention at 32k may not fit: its row says OOM, the patterns keep their numbers."""
    real = train_step.measure
    calls = []

    def full_runs_out(fn, device, warmup, repeats):
        calls.append(1)
        return real(_oom, device, warmup, repeats) if len(calls) == 1 else real(fn, device, warmup, repeats)

    monkeypatch.setattr(train_step, "measure", full_runs_out)
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "32", "--patterns", "s2", "--repeats", "1", "--warmup", "0",
                 "--output", str(out)]) == 0
    full, s2 = json.loads(out.read_text())["results"]
    assert full["ms"] is None and full["tokens_per_s"] is None and full["speedup"] is None
    assert s2["ms"] > 0 and s2["full_tokens_per_s"] is None and s2["speedup"] is None
    assert "| full | 32 | OOM | OOM | OOM | – |" in out.with_suffix(".md").read_text()


def test_bench_keeps_the_rows_measured_before_a_stop(tmp_path):
    """gpu.sh caps each step's time: the rows measured before the cap stay on disk."""
    def rows():
        yield {"seq_len": 1}
        raise KeyboardInterrupt

    args = type("Args", (), {"output": tmp_path / "x.json", "command_line": "sparse-ft bench x", "bench": "x"})()
    with pytest.raises(KeyboardInterrupt):
        bench_cli._sweep(args, "title", rows(), lambda done: f"{len(done)} rows", payload={"machine": "m"})
    payload = json.loads((tmp_path / "x.json").read_text())
    assert payload["complete"] is False and payload["results"] == [{"seq_len": 1}]
    assert (tmp_path / "x.md").read_text() == "title\n\nCommand: `sparse-ft bench x`\n\n1 rows\n\n<!-- sparse_ft_output: sparse-ft bench x -->\n"


@pytest.mark.parametrize("longheads", [False, True])
def test_bench_dca_against_causal_sdpa(tmp_path, capsys, longheads):
    out = tmp_path / "dca.json"
    assert main(["bench", "dca", "--lengths", "150,300", "--pretraining-length", "128", "--heads", "4", "--kv-heads",
                 "2", "--head-dim", "16", "--warmup", "0", "--repeats", "1", "--output", str(out),
                 *(["--longheads"] if longheads else [])]) == 0
    payload = json.loads(out.read_text())
    assert (payload["heads"], payload["kv_heads"], payload["head_dim"], payload["pretraining_length"]) == (4, 2, 16, 128)
    first, second = payload["results"]
    assert first["memory_exponent"] is None and first["chunk_size"] == 96 and first["local_window"] == 32
    for r in (first, second):
        assert r["dca_ms"] > 0 and r["dense_ms"] > 0 and abs(r["time_ratio"] - r["dca_ms"] / r["dense_ms"]) < 1e-9
        if longheads:  # its throughput as a fraction of DCA's
            assert r["longheads_ms"] > 0 and abs(r["longheads_vs_dca_throughput"] - r["dca_ms"] / r["longheads_ms"]) < 1e-9
        else:
            assert "longheads_ms" not in r
    assert "| 300 |" in capsys.readouterr().out and "DCA memory exponent" in out.with_suffix(".md").read_text()
    assert ("LongHeads / DCA throughput" in out.with_suffix(".md").read_text()) == longheads


def test_bench_eval_nf4_against_unquantised(tmp_path):
    out = tmp_path / "eval.json"
    assert main(["bench", "eval", "--lengths", "64", "--warmup", "0", "--repeats", "1", "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["seq_len"] == 64 and row["unquantised_tokens_per_s"] > 0 and row["nf4_tokens_per_s"] > 0
    assert abs(row["nf4_ratio"] - row["nf4_tokens_per_s"] / row["unquantised_tokens_per_s"]) < 1e-9
    # every linear layer not listed as kept is 4-bit: 1/8 of its fp32 bytes and small quantisation statistics
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.config("tiny", 64))
    kept = row["nf4_unquantised_layers"]
    assert "lm_head" in kept and all(name in dict(model.named_modules()) for name in kept)
    quantised = sum(m.weight.numel() * 4 for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and name not in kept) / 2**20
    assert quantised > 0 and row["nf4_weights_mib"] < row["unquantised_weights_mib"] - 0.8 * quantised
    assert abs(row["nf4_ppl"] / row["unquantised_ppl"] - 1) < 0.05  # the same model, quantised


def test_train_baseline_is_the_models_own_attention_on_any_backend():
    chosen = train_step.trained_methods(["s2", "full"], "flex", "bf16")
    assert list(chosen) == ["full", "s2"] and not chosen["full"].replaces_attention
    assert chosen["s2"].pattern.backend == "flex"
