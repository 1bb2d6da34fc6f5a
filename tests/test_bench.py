import json

from sparse_ft.cli import main


def test_bench_attention_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "attention", "--lengths", "64,96", "--heads", "8", "--kv-heads", "2", "--head-dims", "16",
                 "--repeats", "1", "--warmup", "0", "--output", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["machine"] and payload["dtype"] == "fp32"
    rows = payload["results"]
    assert {r["pattern"] for r in rows} == {"s2", "scca_fixed", "scca_flow", "sda", "longmixed"}
    assert {r["seq_len"] for r in rows} == {64, 96}
    for r in rows:
        assert r["ms"] > 0 and r["dense_ms"] > 0
        assert abs(r["speedup"] - r["dense_ms"] / r["ms"]) < 1e-9
        assert r["ideal"] > 1.0  # every sparse pattern computes fewer pairs than causal attention
    assert "| scca_flow | 64 |" in capsys.readouterr().out


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "attention", "--lengths", "64,x"]) == 2
    assert "comma-separated list of integers" in capsys.readouterr().err
    assert main(["bench", "attention", "--lengths", "64", "--patterns", "bogus"]) == 2
    assert "pattern='bogus' is unknown" in capsys.readouterr().err


def test_bench_train_step_cli(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--lengths", "64", "--patterns", "scca_flow", "--repeats", "1", "--warmup", "0",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["pattern"] for r in rows] == ["full", "scca_flow"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["tokens_per_s"] > 0
    assert "| scca_flow | 64 |" in capsys.readouterr().out
