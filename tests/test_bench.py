import json

from sparse_ft.cli import main


def test_bench_attention_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "attention", "--lengths", "64,96", "--heads", "8", "--kv-heads", "2", "--head-dims", "16",
                 "--repeats", "1", "--warmup", "0", "--output", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["machine"] and payload["dtype"] == "fp32" and payload["device"] == "cpu"
    assert "torch threads" in payload["machine"] and "VmHWM" in payload["peak_memory"]
    assert payload["warmup"] == 0 and payload["repeats"] == 1
    rows = payload["results"]
    assert {r["pattern"] for r in rows} == {"s2", "scca_fixed", "scca_flow", "sda", "longmixed"}
    assert {r["seq_len"] for r in rows} == {64, 96}
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
    assert "| scca_flow | 64 |" in capsys.readouterr().out


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "attention", "--lengths", "64,x"]) == 2
    assert "comma-separated list of integers" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--patterns", "bogus"]) == 2
    assert "pattern='bogus' is unknown" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "8", "--kv-heads", "3"]) == 2
    assert "--kv-heads=3 must divide" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--heads", "6", "--patterns", "scca_flow"]) == 2
    assert "num_heads=6" in capsys.readouterr().err


def test_bench_train_step_cli(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "64", "--patterns", "scca_flow", "--repeats", "1", "--warmup", "0",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["pattern"] for r in rows] == ["full", "scca_flow"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["tokens_per_s"] > 0
    assert "| scca_flow | 64 |" in capsys.readouterr().out
