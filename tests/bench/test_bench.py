"""The benchmarks run end to end on CPU at tiny sizes and write what scripts/gpu_bench.sh collects on
a GPU: JSON and a markdown table with the command, rows per size, OOM recorded, not fatal. What
makes them trustworthy is tested with fakes: baseline and patterns run round-robin, every
pattern call runs under the dense kernel's pinned backend, the arithmetic of the ratios."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import attn_patterns
from sparse_ft.bench import attention, dense_kernel, machine, models, train_step
from sparse_ft.bench import cli as bench_cli
from sparse_ft.cli import main

VERSIONS = {"python", "torch", "triton", "cuda", "cudnn", "gpu", "cpu", "torch_threads"}


def _oom():
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")


def test_bench_attention_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "attention", "--lengths", "64,96", "--heads", "8", "--kv-heads", "2", "--head-dims", "16",
                 "--repeats", "2", "--warmup", "0", "--backends", "sdpa", "--output", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["machine"] and payload["dtype"] == "fp32" and payload["device"] == "cpu"
    assert "torch threads" in payload["machine"] and "VmHWM" in payload["peak_memory"]
    assert set(payload["versions"]) == VERSIONS and payload["versions"]["torch"] == torch.__version__
    assert payload["warmup"] == 0 and payload["repeats"] == 2 and payload["complete"] is True
    assert payload["too_few_repeats"] is True and payload["sdpa_backend"] == "auto"
    assert payload["flops"] == "4·pairs·D forward, 3.5× that forward+backward"
    assert payload["command"].startswith("sparse-ft bench attention --lengths 64,96")
    rows = payload["results"]
    assert {r["pattern"] for r in rows} == {"s2", "scca_fixed", "scca_flow", "sda", "longmixed", "sf_attn"}
    assert {r["seq_len"] for r in rows} == {64, 96} and {r["backend"] for r in rows} == {"sdpa"}
    for r in rows:
        assert (r["heads"], r["kv_heads"], r["head_dim"]) == (8, 2, 16)
        # fp32 on a CPU: torch's fused CPU kernel, named by the profiler, forward and backward
        assert r["dense_kernel"] == {"backend": "FLASH_ATTENTION", "kernels": ["", ""],
                                     "ops": ["aten::_scaled_dot_product_flash_attention_for_cpu",
                                             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]}
        assert 0 < r["ms_min"] <= r["ms_median"] and 0 < r["dense_ms_min"] <= r["dense_ms_median"]
        assert r["speedup"] == pytest.approx(r["dense_ms_median"] / r["ms_median"])
        assert r["speedup_min"] == pytest.approx(r["dense_ms_min"] / r["ms_min"])
        assert r["fraction_of_ideal"] == pytest.approx(r["speedup"] / r["ideal"])
        assert r["fraction_of_ideal_min"] == pytest.approx(r["speedup_min"] / r["ideal"])
        # of ideal is the pattern's TFLOP/s over its own pairs against the dense kernel's
        assert r["fraction_of_ideal"] == pytest.approx(r["tflops"] / r["dense_tflops"])
        causal_pairs = 8 * r["seq_len"] * (r["seq_len"] + 1) // 2
        assert r["dense_tflops"] == pytest.approx(14 * causal_pairs * 16 / r["dense_ms_median"] / 1e9)
        assert r["ideal"] > 1.0  # every sparse pattern computes fewer pairs than causal attention
        assert r["peak_mib"] == r["peak_mib"] and r["dense_peak_mib"] == r["dense_peak_mib"]  # measured, not NaN
        assert r["error"] is None and r["dense_error"] is None
    s2_64 = next(r for r in rows if r["pattern"] == "s2" and r["seq_len"] == 64)
    # N=64, w=16: 4 heads in chunks of 16 (4·136 pairs), 4 heads in 8|16|16|16|8 (36+3·136+36).
    assert s2_64["ideal"] == (8 * 64 * 65 / 2) / (4 * 4 * 136 + 4 * (36 + 3 * 136 + 36))
    printed = capsys.readouterr().out
    assert "| scca_flow | sdpa | 64 |" in printed and "min and median of 2 measured rounds (fewer than 5" in printed
    markdown = out.with_suffix(".md").read_text()
    assert f"Command: `{payload['command']}`" in markdown and "| longmixed | sdpa | 96 |" in markdown
    assert "- flash: FLASH_ATTENTION, aten::_scaled_dot_product_flash_attention_for_cpu" in markdown


def _fake_patterns(monkeypatch, calls, *, refuse=()):
    """Patterns s2 and sda replaced by fakes that record each call (name, whether SDPA was
    pinned) and return dense causal attention; the dense baseline records its calls too. A name
    in ``refuse`` fails as SDPA does when no allowed kernel takes a call."""
    real_get = attn_patterns.get

    def record(name):
        calls.append((name, not torch.backends.cuda.math_sdp_enabled()))

    class Fake:
        def __init__(self, name):
            self.name = name

        def __call__(self, q, k, v):
            record(self.name)
            if self.name in refuse:
                raise RuntimeError("No available kernel. Aborting execution.")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def visible_pairs(self, n, h):
            return real_get("causal").visible_pairs(n, h) // 2

    def dense(q, k, v):
        record("dense")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    monkeypatch.setattr(attn_patterns, "get", lambda name, **kw: real_get(name) if name == "causal" else Fake(name))
    monkeypatch.setattr(attention, "_dense", dense)


def test_bench_attention_interleaves_baseline_and_patterns_under_the_pinned_kernel(monkeypatch):
    """One unpinned profiled dense call names the kernel; then warm-up, measured and peak-memory
    rounds of baseline, s2, sda in turn, every call (patterns' included) with SDPA pinned."""
    calls = []
    _fake_patterns(monkeypatch, calls)
    rows = list(attention.run([32], [2], [8], ["s2", "sda"], warmup=1, repeats=5))
    assert calls == [("dense", False)] + [("dense", True), ("s2", True), ("sda", True)] * (1 + 5 + 1)
    assert [r.pattern for r in rows] == ["s2", "sda"] and all(r.ideal == pytest.approx(2, rel=0.02) for r in rows)
    assert rows[0].dense_kernel.backend == "FLASH_ATTENTION" and rows[0].dense_kernel.label == "flash"


def test_a_pattern_the_pinned_kernel_cannot_run_gets_a_row_saying_so(monkeypatch):
    calls = []
    _fake_patterns(monkeypatch, calls, refuse={"s2"})
    s2, sda = attention.run([32], [2], [8], ["s2", "sda"], warmup=0, repeats=2)
    assert s2.ms_median is None and s2.speedup is None and s2.error.startswith("no flash kernel for one of its SDPA")
    assert sda.ms_median > 0 and sda.error is None
    assert calls.count(("s2", True)) == 1  # dropped at its first run; the others went on
    table = attention.markdown([s2, sda])
    assert "| s2 | sdpa | 32 | 2 | 2 | 8 | no kernel | no kernel |" in table and "- s2 (sdpa) at N=32: no flash kernel" in table


def test_dense_kernel_named_and_pinned_on_cpu():
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    step = attention._step(attention._dense, q, q.detach().clone(), q.detach().clone())
    picked = dense_kernel.find(step, torch.device("cpu"))
    assert picked.backend == "FLASH_ATTENTION" and picked.ops[0] == "aten::_scaled_dot_product_flash_attention_for_cpu"
    asked = dense_kernel.find(step, torch.device("cpu"), "math")
    assert asked.backend == "MATH" and asked.ops == ("aten::_scaled_dot_product_attention_math",)
    with pytest.raises(ValueError, match="--sdpa-backend cudnn: SDPA has no cudnn kernel for a dense causal call"):
        dense_kernel.find(step, torch.device("cpu"), "cudnn")
    assert bench_cli.SDPA_BACKENDS == list(dense_kernel.BACKENDS)  # the parser's list, without importing torch


def test_flops_are_flash_attentions_count():
    """4·pairs·D forward, 2.5× that backward: the issue's 584 TFLOP/s for the H200's dense
    forward+backward at 32k (H=32, D=128, 52.75 ms)."""
    assert dense_kernel.flops(1, 1, backward=False) == 4 and dense_kernel.flops(1, 1, backward=True) == 14
    pairs = attn_patterns.get("causal").visible_pairs(32768, 32)
    assert dense_kernel.tflops(pairs, 128, 52.75172400001793, backward=True) == pytest.approx(583.6, abs=0.1)
    assert dense_kernel.tflops(pairs, 128, None, backward=True) is None


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "attention", "--lengths", "64,x"]) == 2
    assert "comma-separated list of integers" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--patterns", "bogus"]) == 2
    assert "pattern='bogus' is unknown" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--kv-heads=3 must divide" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "6", "--patterns", "scca_flow"]) == 2
    assert "num_heads=6" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "sdpa,bogus"]) == 2
    assert "bench attention: --backends bogus: backend='bogus' is unknown; allowed: sdpa" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "flex", "--device", "cpu"]) == 2
    assert "flex needs CUDA" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--backends", "flash", "--device", "cpu"]) == 2
    assert "--backends flash: backend='flash' needs the flash-attn package and CUDA" in capsys.readouterr().err
    assert main(["bench", "train", "--lengths", "64", "--backend", "flash", "--device", "cpu"]) == 2
    assert "bench train: --backend flash: backend='flash' needs the flash-attn package" in capsys.readouterr().err
    assert main(["bench", "train", "--lengths", "64", "--backend", "sdpa,flex"]) == 2
    assert "bench train: --backend='sdpa,flex' names one backend" in capsys.readouterr().err
    assert main(["bench", "dca", "--lengths", "64", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--heads=8 must be a multiple of --kv-heads=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "train", "--model", "7b"])
    assert "invalid choice: '7b'" in capsys.readouterr().err


def test_bench_backends_are_the_patterns_to_refuse(monkeypatch):
    """--backends passes a name such as triton to the patterns' own check: accepted when they
    take it, refused with their message when not."""
    import attn_patterns.kernels as kernels

    real = kernels.resolve_backend
    monkeypatch.setattr(kernels, "resolve_backend", lambda b, q: b if b == "triton" else real(b, q))
    assert bench_cli._backends("sdpa,triton", torch.device("cpu"), "fp32", "--backends") == ["sdpa", "triton"]
    assert bench_cli.BACKENDS == ", ".join(kernels.BACKENDS)  # the help text's list, without importing torch


def test_bench_train_step_lora_with_checkpointing(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "32", "--patterns", "scca_flow", "--repeats", "2", "--warmup", "0",
                 "--model", "tiny", "--gradient-checkpointing", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["model"] == "tiny" and payload["gradient_checkpointing"] is True and payload["complete"] is True
    assert set(payload["versions"]) == VERSIONS and payload["too_few_repeats"] is True
    assert set(payload["peak_memory"]) == {"step", "attention"}
    full, free, flow = payload["results"]
    assert [r["pattern"] for r in (full, free, flow)] == ["full", "no attention", "scca_flow"]
    a = 1 - free["ms_median"] / full["ms_median"]
    for r in (full, free, flow):
        assert r["attention_share"] == pytest.approx(a) and 0 < r["ms_min"] <= r["ms_median"]
        assert r["speedup"] == pytest.approx(full["ms_median"] / r["ms_median"])
        assert r["fraction_of_bound"] == pytest.approx(r["speedup"] / r["amdahl_bound"])
        assert r["step_peak_mib"] > 0 and r["attention_peak_mib"] is None  # CUDA only
    assert full["speedup"] == 1.0 and full["ideal"] == 1.0 and full["amdahl_bound"] == pytest.approx(1.0)
    assert free["ideal"] is None and free["amdahl_bound"] == pytest.approx(1 / (1 - a))  # attention free
    assert flow["ideal"] > 2 and flow["amdahl_bound"] == pytest.approx(1 / ((1 - a) + a / flow["ideal"]))
    assert flow["tokens_per_s"] == pytest.approx(32 / flow["ms_median"] * 1e3)
    assert "| scca_flow | 32 |" in capsys.readouterr().out
    markdown = out.with_suffix(".md").read_text()
    assert "LoRA+" in markdown and "| no attention | 32 |" in markdown and "Amdahl bound" in markdown


def test_amdahl_bound():
    """The issue's arithmetic: attention 39 % of an 8B step at 32k; free attention gives at most
    1.64×, a pattern at 4× its ideal 1.41×."""
    assert train_step.amdahl_bound(0.39, math.inf) == pytest.approx(1.639, abs=1e-3)
    assert train_step.amdahl_bound(0.39, 4.0) == pytest.approx(1 / (0.61 + 0.0975))
    assert train_step.amdahl_bound(0.39, 1.0) == pytest.approx(1.0) and train_step.amdahl_bound(0.0, 8.0) == 1.0


def test_no_attention_keeps_shapes_and_the_projections_in_the_graph():
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(2))
    out, weights = train_step.NoAttention()(None, q, k, v, None, scaling=0.5)
    assert out.shape == (1, 16, 4, 8) and weights is None and torch.equal(out, q.transpose(1, 2))
    out.sum().backward()
    assert torch.equal(q.grad, torch.ones_like(q)) and torch.equal(k.grad, torch.zeros_like(k)) and v.grad is not None


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
    order = []
    got = machine.interleaved({"dense": _oom, "dca": lambda: order.append("dca")}, cpu, 1, 5)
    assert got["dense"] == machine.Timing(error="OOM") and 0 <= got["dca"].min_ms <= got["dca"].median_ms
    assert order == ["dca"] * (1 + 5 + 1)
    assert machine.cell(None, ".1f") == "OOM" and machine.cell(None, ".2f", "–", "×") == "–"


def test_bench_train_records_full_attention_oom(tmp_path, monkeypatch, capsys):
    """Full attention at 32k may not fit: its row says OOM, the patterns keep their numbers."""
    real = train_step.install_method

    def full_runs_out(net, method):
        if method.name == "full":
            _oom()
        return real(net, method)

    monkeypatch.setattr(train_step, "install_method", full_runs_out)
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "32", "--patterns", "s2", "--repeats", "1", "--warmup", "0",
                 "--output", str(out)]) == 0
    full, free, s2 = json.loads(out.read_text())["results"]
    assert full["ms_median"] is None and full["tokens_per_s"] is None and full["speedup"] is None
    assert full["error"] == "OOM" and full["attention_peak_mib"] is None
    assert s2["ms_median"] > 0 and s2["full_tokens_per_s"] is None and s2["speedup"] is None
    assert s2["attention_share"] is None and s2["amdahl_bound"] is None and free["ms_median"] > 0
    assert "| full | 32 | OOM | OOM | OOM | OOM | – | – | 1.00× | – | – | – | OOM | OOM |" in out.with_suffix(".md").read_text()


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
    assert (tmp_path / "x.md").read_text() == ("title\n\nCommand: `sparse-ft bench x`\n\n1 rows\n\n"
                                                "<!-- sparse_ft_output: sparse-ft bench x -->\n")


@pytest.mark.parametrize("longheads", [False, True])
def test_bench_dca_against_causal_sdpa(tmp_path, capsys, longheads):
    out = tmp_path / "dca.json"
    assert main(["bench", "dca", "--lengths", "150,300", "--pretraining-length", "128", "--heads", "4", "--kv-heads",
                 "2", "--head-dim", "16", "--warmup", "0", "--repeats", "1", "--output", str(out),
                 *(["--longheads"] if longheads else [])]) == 0
    payload = json.loads(out.read_text())
    assert (payload["heads"], payload["kv_heads"], payload["head_dim"], payload["pretraining_length"]) == (4, 2, 16, 128)
    assert set(payload["versions"]) == VERSIONS and payload["repeats"] == 1 and payload["too_few_repeats"] is True
    first, second = payload["results"]
    assert first["memory_exponent"] is None and first["chunk_size"] == 96 and first["local_window"] == 32
    for r in (first, second):
        assert r["dense_kernel"]["backend"] == "FLASH_ATTENTION" and r["errors"] == {}
        assert r["dca_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]  # DCA's pieces, named
        assert r["dca_ms_min"] <= r["dca_ms_median"] and r["dense_ms_min"] <= r["dense_ms_median"]
        assert r["time_ratio"] == pytest.approx(r["dca_ms_median"] / r["dense_ms_median"])
        assert r["time_ratio_min"] == pytest.approx(r["dca_ms_min"] / r["dense_ms_min"])
        assert r["dca_tflops"] / r["dense_tflops"] == pytest.approx(1 / r["time_ratio"])  # the same causal FLOPs
        if longheads:  # its throughput as a fraction of DCA's
            assert r["longheads_ms_median"] > 0
            assert r["longheads_vs_dca_throughput"] == pytest.approx(r["dca_ms_median"] / r["longheads_ms_median"])
        else:
            assert "longheads_ms_median" not in r
    assert "| 300 |" in capsys.readouterr().out and "DCA memory exponent" in out.with_suffix(".md").read_text()
    assert ("LongHeads / DCA throughput" in out.with_suffix(".md").read_text()) == longheads


def test_bench_eval_nf4_against_unquantised(tmp_path):
    out = tmp_path / "eval.json"
    assert main(["bench", "eval", "--lengths", "64", "--warmup", "0", "--repeats", "1", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["versions"]) == VERSIONS
    (row,) = payload["results"]
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


@pytest.mark.gpu
def test_dense_kernel_and_call_peak_on_cuda():
    """On a GPU the profiler names a device kernel under SDPA's op, and a call's own peak is
    measured without losing the enclosing region's (the CUDA allocator's counter is reset per call)."""
    cuda = torch.device("cuda")
    q = torch.randn(1, 8, 1024, 64, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, 2, 1024, 64, device=cuda, dtype=torch.bfloat16)
    picked = dense_kernel.find(attention._step(attention._dense, q, kv.clone().requires_grad_(), kv.clone().requires_grad_()), cuda)
    assert picked.backend in dense_kernel.BACKEND_OF_OP.values() and picked.kernels[0], picked
    mib = 2**20
    own = machine.CallPeak(cuda)
    call = own.wrap(lambda: torch.empty(64 * mib, dtype=torch.uint8, device=cuda).sum())
    region = machine.PeakMemory(cuda)
    with region.measure():
        big = torch.empty(128 * mib, dtype=torch.uint8, device=cuda)
        del big
        own.start()
        call()
    assert 64 <= own.mib < 96 and 128 <= region.mib < 160


def test_bench_dca_says_failed_not_oom_where_longheads_could_not_run():
    """A LongHeads run that failed for another reason than memory is not shown as OOM (the
    H200's cuDNN pin refused its fp32 call and the table read OOM); the reason is in the notes."""
    from sparse_ft.bench import dca

    row = {"seq_len": 4096, "dense_kernel": None, "dca_ops": [], "dca_ms_min": 1.0, "dca_ms_median": 1.0,
           "dense_ms_min": 1.0, "dense_ms_median": 1.0, "time_ratio": 1.0, "time_ratio_min": 1.0, "dca_tflops": 1.0,
           "dense_tflops": 1.0, "dca_peak_mib": 1.0, "dense_peak_mib": 1.0, "memory_exponent": None,
           "longheads_ms_median": None, "longheads_peak_mib": None, "longheads_vs_dca_throughput": None,
           "errors": {"longheads": "no cudnn kernel for one of its SDPA calls"}}
    table = dca.markdown([row])
    assert "| failed | failed |" in table and "OOM" not in table and "no cudnn kernel" in table
    table = dca.markdown([{**row, "errors": {"longheads": "OOM"}}])
    assert "| OOM | OOM |" in table


def test_patterns_beside_a_cudnn_baseline_are_pinned_to_flash():
    """cuDNN is wrong on strided views (attn_patterns.kernels.PIECE_SDPA): beside a cuDNN
    baseline the patterns' pieces are pinned to FlashAttention, and the table says so."""
    from torch.backends import cuda

    seen = []
    cudnn = dense_kernel.DenseKernel("CUDNN_ATTENTION", ("aten::_scaled_dot_product_cudnn_attention",), ())
    probe = lambda: seen.append((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled()))  # noqa: E731
    cudnn.pin(probe)()
    cudnn.pin(probe, pieces=True)()
    assert cudnn.piece_backend == "FLASH_ATTENTION" and seen == [(True, False), (False, True)]
    flash = dense_kernel.DenseKernel("FLASH_ATTENTION", (), ())
    assert flash.piece_backend == "FLASH_ATTENTION"
    row = next(iter(attention.run([32], [2], [8], ["s2"], warmup=0, repeats=1)))
    table = attention.markdown([dataclasses.replace(row, dense_kernel=cudnn)])
    assert "the patterns' SDPA pieces pinned to FLASH_ATTENTION (cuDNN is wrong on strided views)" in table


def _sink_ideal(name, n, heads):
    """Causal pairs over the pairs of ``name`` built with 4 sink tokens: the sinks' keys counted."""
    return attn_patterns.get("causal").visible_pairs(n, heads) / attn_patterns.get(name, sink_tokens=4).visible_pairs(n, heads)


def test_bench_train_measures_dense_layers_sink_tokens_and_weighs_a_dense_tail(tmp_path):
    """``--dense-layers``: each pattern's step measured with those layers attending fully;
    ``--dense-final-fraction``: the all-dense step measured too, and the run's mean step the
    two weighted; ``--sink-tokens``: the plain pattern's step also with 4 sink tokens, its
    ideal over its own pairs (no sink row with the dense layers or the tail). One run: each
    takes a model build and a round-robin."""
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "32", "--patterns", "s2", "--repeats", "1", "--warmup", "0",
                 "--dense-layers", "0,3", "--dense-final-fraction", "0.25", "--sink-tokens", "4", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["dense_layers"] == [0, 3] and payload["dense_final_fraction"] == 0.25 and payload["sink_tokens"] == 4
    rows = {r["pattern"]: r for r in payload["results"]}
    assert list(rows) == ["full", "no attention", "s2", "s2 + 4 sinks", "s2 + full in [0, 3]", "causal",
                          "s2 + full in [0, 3], dense tail 0.25"]
    sinks = rows["s2 + 4 sinks"]
    assert sinks["ideal"] == pytest.approx(_sink_ideal("s2", 32, models.config("tiny", 32).num_attention_heads))
    assert 1 < sinks["ideal"] < rows["s2"]["ideal"] and sinks["ms_median"] > 0  # the sinks add keys
    a = sinks["attention_share"]
    assert sinks["amdahl_bound"] == pytest.approx(1 / ((1 - a) + a / sinks["ideal"]))
    layers, dense, tail = rows["s2 + full in [0, 3]"], rows["causal"], rows["s2 + full in [0, 3], dense tail 0.25"]
    assert tail["ms_median"] == pytest.approx(0.75 * layers["ms_median"] + 0.25 * dense["ms_median"])
    assert tail["step_peak_mib"] == max(layers["step_peak_mib"], dense["step_peak_mib"])
    assert 1 / dense["ideal"] == pytest.approx(1.0) and 1 < layers["ideal"] < rows["s2"]["ideal"]
    assert 1 / layers["ideal"] == pytest.approx(0.5 / rows["s2"]["ideal"] + 0.5)  # two of the four layers dense
    assert 1 / tail["ideal"] == pytest.approx(0.75 / layers["ideal"] + 0.25)
    title = out.with_suffix(".md").read_text()
    assert "Rows 'dense tail 0.25'" in title and "Rows 'PATTERN + 4 sinks'" in title


def test_bench_attention_measures_each_pattern_with_sink_tokens(tmp_path):
    """``--sink-tokens 4``: each pattern's row, then its row with 4 sink tokens, whose ideal
    counts the sinks' pairs; sf_attn, which has 4 of its own, gets the row too."""
    out = tmp_path / "bench.json"
    assert main(["bench", "attention", "--lengths", "64", "--heads", "8", "--head-dims", "16", "--patterns", "s2,sf_attn",
                 "--repeats", "1", "--warmup", "0", "--sink-tokens", "4", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["sink_tokens"] == 4
    rows = {r["pattern"]: r for r in payload["results"]}
    assert list(rows) == ["s2", "s2 + 4 sinks", "sf_attn", "sf_attn + 4 sinks"]
    for name in ("s2", "sf_attn"):
        mine = rows[attention.sinks_name(name, 4)]
        assert mine["ideal"] == pytest.approx(_sink_ideal(name, 64, 8)) and mine["error"] is None
        assert mine["fraction_of_ideal"] == pytest.approx(mine["tflops"] / mine["dense_tflops"])  # over its own pairs
    assert rows["s2 + 4 sinks"]["ideal"] < rows["s2"]["ideal"]  # the sinks add keys
    assert rows["sf_attn + 4 sinks"]["ideal"] == rows["sf_attn"]["ideal"]  # its own 4, replaced by 4
    assert "Rows 'PATTERN + 4 sinks'" in out.with_suffix(".md").read_text()
