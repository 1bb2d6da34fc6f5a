"""Both scoring modes against hand-computed examples, the passkey prompt builder, 4-bit
against fp32, and the CLI end to end on a tiny model."""

import json
import math

import numpy as np
import pytest
import torch

from sparse_ft.cli import main
from sparse_ft.evaluation import methods, passkey, ppl
from sparse_ft.evaluation.scoring import window_nll
from sparse_ft.evaluation.windows import Window, plan
from sparse_ft.tiny import tiny_llama, tiny_tokenizer


def test_standard_windows_by_hand():
    # 10 tokens, L=4, stride 2: windows [0,4) [2,6) [4,8) [6,10); the first scores its 3
    # predictions (tokens 1..3), each later one the 2 tokens no window scored before.
    assert plan(10, 4, 2) == [Window(0, 4, 0, 3), Window(2, 6, 3, 5), Window(4, 8, 5, 7), Window(6, 10, 7, 9)]
    assert sum(w.scored for w in plan(10, 4, 2)) == 9  # every token but the first, exactly once
    # A stride larger than the window leaves nothing scored twice and ends at the data's end.
    assert plan(7, 3, 5) == [Window(0, 3, 0, 2), Window(5, 7, 5, 6)]
    assert plan(10, 4, 2, max_windows=2) == plan(10, 4, 2)[:2]


def test_longlora_windows_by_hand():
    # range(0, 10 - 4, 2) = 0, 2, 4 and LongLoRA pops the last: windows at 0 and 2, each
    # scoring all 4 predictions (targets 1..4 and 3..6).
    assert plan(10, 4, 2, "longlora") == [Window(0, 4, 0, 4), Window(2, 6, 2, 6)]
    with pytest.raises(ValueError, match="needs more than length\\+stride=6 tokens, the data has 5"):
        plan(5, 4, 2, "longlora")


class TableModel(torch.nn.Module):
    """A 'model' whose log-probability of each next token we choose: NLL(token t) = t / 10."""

    def __init__(self, vocab=16):
        super().__init__()
        self.vocab = vocab
        self.config = type("C", (), {"final_logit_softcapping": None})()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def get_decoder(self):
        return lambda input_ids, use_cache: type("O", (), {"last_hidden_state": input_ids})()

    def get_output_embeddings(self):
        def head(hidden):
            # logits making p(next = t) proportional to exp(-t/10) for every position: NLL(t) = t/10 + log Z
            logits = -torch.arange(self.vocab, dtype=torch.float32) / 10
            return logits.expand(*hidden.shape, self.vocab)

        return head


def test_perplexity_matches_hand_computation():
    model = TableModel()
    log_z = math.log(sum(math.exp(-t / 10) for t in range(16)))
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    nll = lambda ts: [t / 10 + log_z for t in ts]  # noqa: E731
    # standard: each of tokens[1:] scored once
    got = ppl.evaluate_length(model, tokens, 4, 2, "standard", methods.get("full"))
    assert got["tokens"] == 9
    assert got["ppl"] == pytest.approx(math.exp(sum(nll(tokens[1:])) / 9), rel=1e-6)
    # longlora: windows [0,4) and [2,6) with targets tokens[1:5] and tokens[3:7]; mean of means
    got = ppl.evaluate_length(model, tokens, 4, 2, "longlora", methods.get("full"))
    w1, w2 = np.mean(nll(tokens[1:5])), np.mean(nll(tokens[3:7]))
    assert got["tokens"] == 8 and got["ppl"] == pytest.approx(math.exp((w1 + w2) / 2), rel=1e-6)


def test_chunked_loss_equals_the_full_logits_loss():
    model = tiny_llama()
    ids = torch.randint(3, 380, (2, 70))
    targets = ids[:, 11:70]
    chunked = window_nll(model, ids, targets, 10, 69, chunk=16)
    with torch.no_grad():
        logits = model(ids).logits[:, 10:69]
    full = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_puts_the_needle_at_the_depth(depth):
    tok = tiny_tokenizer()
    prompt = passkey.build_prompt(tok, 2000, depth, "48213")
    text = tok.decode(prompt.ids)
    assert text.startswith(passkey.TASK) and text.endswith(passkey.QUESTION)
    assert passkey.needle("48213") in text and text.count("48213") == 2
    assert 2000 - 100 <= len(prompt.ids) <= 2000  # filler comes in whole sentences (~90 bytes)
    filler_tokens = len(prompt.context_ids) - len(tok(passkey.TASK, add_special_tokens=False).input_ids) \
        - len(tok(" " + passkey.needle("48213"), add_special_tokens=False).input_ids)
    before = prompt.needle_token - len(tok(passkey.TASK, add_special_tokens=False).input_ids)
    assert before / filler_tokens == pytest.approx(depth, abs=0.06)
    assert tok.decode(prompt.question_ids).strip() == passkey.QUESTION


def test_passkey_scoring_is_exact_match():
    assert passkey.retrieved(" 48213. Remember", "48213")
    assert not passkey.retrieved(" 4821", "48213") and not passkey.retrieved(" 48231", "48213")


def test_methods_registry_and_rope_baselines():
    model = tiny_llama()
    inv = model.model.rotary_emb.inv_freq.clone()
    pi = methods.get("pi")
    pi.apply(model, 1024)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv / 4)
    pi.apply(model, 512)  # the factor follows each length, from the loaded configuration
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv / 2)
    pi.apply(model, 128)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv)
    methods.get("yarn").apply(tiny := tiny_llama(), 1024)
    assert tiny.config.rope_parameters["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="--method 'nope' is unknown; allowed: .*full.*ntk.*scca_flow"):
        methods.get("nope")
    with pytest.raises(ValueError, match="takes no --method-arg"):
        methods.get("pi", factor=2)


def test_four_bit_ppl_is_close_to_fp32(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    results = {}
    for flag in ([], ["--load-in-4bit"]):
        out = tmp_path / f"r{len(flag)}.json"
        assert main(["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "128", "--stride", "64",
                     "--output", str(out), *flag]) == 0
        results[bool(flag)] = json.loads(out.read_text())["results"][0]["ppl"]
    assert results[True] != results[False]  # quantisation happened
    assert abs(results[True] / results[False] - 1) < 0.03


def test_cli_end_to_end(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(6)))
    out, png = tmp_path / "ppl.json", tmp_path / "ppl.png"
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64,128", "--stride", "32",
                 "--num-windows", "4", "--method", "pi", "--output", str(out), "--plot", str(png)]) == 0
    payload = json.loads(out.read_text())
    assert [r["length"] for r in payload["results"]] == [64, 128] and payload["config"]["method"] == "pi"
    assert all(r["ppl"] > 1 and r["tokens"] > 0 and r["tokens_per_second"] > 0 for r in payload["results"])
    assert png.stat().st_size > 1000 and "| pi | 64 |" in capsys.readouterr().out
    assert main(["eval", "plot", str(out), str(out), "--output", str(tmp_path / "two.png")]) == 0
    pk, heat = tmp_path / "pk.json", tmp_path / "pk.png"
    assert main(["eval", "passkey", "--model", "tiny", "--lengths", "300", "--depths", "0,1", "--trials", "2",
                 "--output", str(pk), "--heatmap", str(heat)]) == 0
    cells = json.loads(pk.read_text())["results"]
    assert [(c["length"], c["depth"], c["trials"]) for c in cells] == [(300, 0.0, 2), (300, 1.0, 2)]
    assert heat.stat().st_size > 1000


def test_bin_token_files_and_bad_input(tmp_path, capsys):
    from sparse_ft.evaluation.tokens import write_token_file

    path = write_token_file(np.arange(3, 303) % 380, tmp_path / "t.bin", 384, "byt5")
    assert json.loads(path.with_suffix(".json").read_text())["dtype"] == "uint16"
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(path), "--lengths", "64", "--stride", "64"]) == 0
    capsys.readouterr()
    cases = [
        (["--data", str(path), "--lengths", "1000"], "--lengths 1000 is longer than the 300 tokens"),
        (["--data", str(tmp_path / "missing.bin"), "--lengths", "64"], "does not exist"),
        (["--data", str(path), "--lengths", "64", "--method", "bogus"], "--method 'bogus' is unknown"),
        (["--data", str(path), "--lengths", "6x"], "must be a comma-separated list of integers"),
    ]
    big = write_token_file(np.array([5, 900, 7] * 40), tmp_path / "big.bin", 70000, "other")
    cases.append((["--data", str(big), "--lengths", "64", "--data-dtype", "uint32"], "token id 900 >= the model's vocabulary size 384"))
    for extra, message in cases:
        assert main(["eval", "ppl", "--model", "tiny", *extra]) == 2
        assert message in capsys.readouterr().err


def test_prepare_eval_and_adapter_evaluation(tmp_path, capsys):
    import subprocess
    import sys
    from pathlib import Path

    from sparse_ft.config import load_recipe
    from sparse_ft.train.loop import train

    root = Path(__file__).resolve().parent.parent
    text = tmp_path / "book.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 30)
    done = subprocess.run([sys.executable, "data/prepare_eval.py", "--tokenizer", "tiny", "--source", str(text),
                           "--output", str(tmp_path / "book.bin")], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.fromfile(tmp_path / "book.bin", dtype=np.uint16).size == len(text.read_text()) + 1
    run = tmp_path / "run"
    train(load_recipe("tiny", [f"train.output_dir={run}", f"data.cache_dir={tmp_path / 'c'}", "deepspeed=null",
                               "train.max_steps=2", "train.report_to=[none]"]))
    base = str(run / "base-model")
    assert main(["eval", "ppl", "--model", base, "--adapter", str(run / "adapter"), "--data", str(tmp_path / "book.bin"),
                 "--lengths", "512", "--stride", "256", "--output", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["results"][0]["tokens"] > 0
    other = tmp_path / "other"
    tiny_llama(hidden_size=128, intermediate_size=256).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(other), "--adapter", str(run / "adapter"), "--data", str(tmp_path / "book.bin"),
                 "--lengths", "64"]) == 2
    assert "was trained on a base with hidden_size=64, but" in capsys.readouterr().err
