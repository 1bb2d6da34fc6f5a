"""Both scoring modes against hand-computed examples, the passkey prompt builder, 4-bit
against fp32, and the CLI end to end on a tiny model."""

import json
import math

import numpy as np
import pytest
import torch

from sparse_ft.cli import main
from sparse_ft import methods
from sparse_ft.evaluation import passkey_prompt, window_perplexity
from sparse_ft.evaluation.tasks import passkey
from sparse_ft.evaluation.scoring import window_nll
from sparse_ft.evaluation.windows import Window, plan
from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer


def test_standard_windows_by_hand():
    # 10 tokens, L=4, stride 2: windows [0,4) [2,6) [4,8) [6,10); the first scores its 3
    # predictions (tokens 1..3), each later one the 2 tokens no window scored before.
    assert plan(10, 4, 2) == [Window(0, 4, 0, 3), Window(2, 6, 3, 5), Window(4, 8, 5, 7), Window(6, 10, 7, 9)]
    assert sum(w.scored for w in plan(10, 4, 2)) == 9  # every token but the first, exactly once
    # Disjoint windows (stride = L) cannot score a window's first token; a stride longer than the
    # window would also leave the tokens between two windows unscored (3 and 4 here): refused.
    assert sum(w.scored for w in plan(7, 3, 3)) == 4
    with pytest.raises(ValueError, match=r"--stride 5 is longer than the window --lengths 3: the 2 tokens between two "
                                         r"windows would never be scored; use --stride <= 3"):
        plan(7, 3, 5)
    assert plan(10, 4, 2, max_windows=2) == plan(10, 4, 2)[:2]


def test_longlora_windows_by_hand():
    # range(0, 10 - 4, 2) = 0, 2, 4 and LongLoRA pops the last: windows at 0 and 2. The model is
    # called with labels=input_ids, so each scores the 3 predictions inside it (tokens 1..3, 3..5).
    assert plan(10, 4, 2, "longlora") == [Window(0, 4, 0, 3), Window(2, 6, 2, 5)]
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
    got = window_perplexity.evaluate_length(model, tokens, 4, 2, scoring="standard", method=methods.get("full"))
    assert got["tokens"] == 9
    assert got["ppl"] == pytest.approx(math.exp(sum(nll(tokens[1:])) / 9), rel=1e-6)
    # by hand: exp(mean NLL of 1,4,1,5,9,2,6,5,3) = exp(0.4 + log Z)
    assert got["ppl"] == pytest.approx(math.exp(0.4 + log_z), rel=1e-6)
    # longlora: windows [0,4) and [2,6) with targets tokens[1:4] = 1,4,1 and tokens[3:6] = 1,5,9;
    # mean of window means = (0.2 + 0.5) / 2 = 0.35, plus log Z
    for batch_size in (1, 2):
        got = window_perplexity.evaluate_length(model, tokens, 4, 2, scoring="longlora", method=methods.get("full"),
                                  batch_size=batch_size)
        assert got["tokens"] == 6 and got["ppl"] == pytest.approx(math.exp(0.35 + log_z), rel=1e-6)
    # standard with a stride that leaves a short last window: [0,4) [3,7) [6,10) score 3+3+3
    got = window_perplexity.evaluate_length(model, tokens, 4, 3, scoring="standard", method=methods.get("full"), batch_size=2)
    assert got["tokens"] == 9 and got["ppl"] == pytest.approx(math.exp(0.4 + log_z), rel=1e-6)


def test_chunked_loss_equals_the_full_logits_loss():
    model = tiny_llama()
    ids = torch.randint(3, 380, (2, 70))
    targets = ids[:, 11:70]
    chunked = window_nll(model, ids, targets, 10, last=69, chunk=16)
    with torch.no_grad():
        logits = model(ids).logits[:, 10:69]
    full = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length,depth", [(2000, 0.0), (2000, 0.3), (1500, 0.5), (2001, 1.0)])
def test_passkey_prompt_puts_the_needle_at_the_depth(length, depth):
    tok = tiny_tokenizer()
    prompt = passkey_prompt.build_prompt(tok, length, depth, "48213")
    assert len(prompt.ids) == length  # the filler is cut in tokens: the length is exact
    text = tok.decode(prompt.ids)
    before = text.index(passkey_prompt.needle("48213"))
    head = passkey_prompt.TASK + "\n"
    # landmark's layout: task, filler, needle, filler, question, one per line
    assert text.startswith(head) and text.endswith("\n" + passkey_prompt.QUESTION)
    assert text.count("48213") == 2 and text[before - 1] == "\n"
    filler = text[len(head) : before - 1] + text[before + len(passkey_prompt.needle("48213")) + 1 : -len(passkey_prompt.QUESTION) - 1]
    assert prompt.filler_tokens == len(filler)  # bytes are tokens here
    assert text[len(head) : before - 1] == (" ".join([passkey_prompt.FILLER] * 30))[: round(depth * len(filler))]
    assert prompt.needle_token == len(tok(head, add_special_tokens=False).input_ids) + round(depth * len(filler))
    assert tok.decode(prompt.question_ids) == "\n" + passkey_prompt.QUESTION
    with pytest.raises(ValueError, match="shorter than the prompt without filler"):
        passkey_prompt.build_prompt(tok, 200, depth, "48213")


def test_passkey_scoring_is_exact_match():
    assert passkey.retrieved(" 48213. Remember", "48213")
    assert not passkey.retrieved(" 4821", "48213") and not passkey.retrieved(" 48231", "48213")
    assert not passkey.retrieved(" 482130", "48213") and not passkey.retrieved(" none", "48213")


def test_reprefill_generation_equals_cached_generation():
    model, tok = tiny_llama(), tiny_tokenizer()
    prompt = passkey_prompt.build_prompt(tok, 300, 0.5, "12345")
    asked = dict(context_ids=prompt.context_ids, question_ids=prompt.question_ids, max_new_tokens=6)
    cached = methods.cached_generate(model, tok, **asked)
    assert methods.reprefill_generate(model, tok, **asked) == cached
    assert not methods.get("s2").supports.kv_cache  # training patterns have no decode step: they re-run
    assert methods.get("s2").generate(model, tok, **asked) != []


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
    fixed = methods.get("pi", factor=2)  # LongLoRA-style: one factor for every length
    fixed.apply(model, 128)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv / 2)
    with pytest.raises(ValueError, match="factor=0.5 must be a number >= 1"):
        methods.get("ntk", factor=0.5)
    with pytest.raises(ValueError, match="--method pi: bad --method-arg .*alpha"):
        methods.get("pi", alpha=2)
    with pytest.raises(ValueError, match="--method full takes no --method-arg; got x"):
        methods.get("full", x=1)
    with pytest.raises(ValueError, match="scca_flow: parameter\\(s\\) bogus unknown"):
        methods.get("scca_flow", bogus=3)


# widths all multiples of 32 (every linear layer quantises everywhere), and deliberately not (k/v
# 16, MLP 344: bitsandbytes 0.50's AVX512-BF16 CPU kernel packs neither as output nor as input width)
SHAPES = {"aligned": dict(num_key_value_heads=4), "odd": dict(intermediate_size=344)}


@pytest.mark.parametrize("shape", SHAPES)
def test_quantised_ppl_is_close_to_fp32(tmp_path, shape):
    """NF4 (and 8-bit) on bitsandbytes' CPU backend (tests/evaluation/test_cuda_nf4.py: its CUDA one)."""
    check_quantised_ppl(tmp_path, "cpu", shape)


def check_quantised_ppl(tmp_path, device: str, shape: str):
    """NF4 (and 8-bit) on ``device``, on a tiny model trained until its PPL is far from uniform
    (a random model's PPL ~ vocabulary size hides broken weights). Every linear layer is NF4
    but the output head and, for odd widths, those bitsandbytes refuses on ``device``."""
    import bitsandbytes as bnb

    from sparse_ft.evaluation import loading
    from sparse_ft.modeling.quantization import unquantised_layers

    text = b"The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    tokens = np.frombuffer(text * 8, dtype=np.uint8).astype(np.int64) + 3  # ByT5 ids: byte + 3
    model, ids = tiny_llama(**SHAPES[shape]).to(device).train(), torch.from_numpy(tokens[:128])[None].to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(50):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    results = {}
    for flag in ("fp32", "load_in_4bit", "load_in_8bit"):
        loaded, _ = loading.load(str(tmp_path / "m"), device=device, **({} if flag == "fp32" else {flag: True}))
        results[flag] = window_perplexity.evaluate_length(loaded, tokens, 128, 64, scoring="standard",
                                            method=methods.get("full"))["ppl"]
        if flag == "load_in_4bit":  # NF4 with double quantisation really ran, not an fp32 fallback
            kept = unquantised_layers(loaded)
            linears = {name: m for name, m in loaded.named_modules() if isinstance(m, torch.nn.Linear)}
            odd = {n for n, m in linears.items() if m.out_features % 32 or m.in_features % 32}
            assert "lm_head" in kept and set(kept) <= {"lm_head"} | odd and (odd or kept == ["lm_head"])
            layers = [m for name, m in linears.items() if name not in kept]
            assert all(isinstance(m, bnb.nn.Linear4bit) for m in layers) and len(layers) + len(kept) == 15
            states = [m.weight.quant_state for m in layers]  # the AVX512-BF16 repacking keeps the original flag aside
            assert all(s.quant_type == "nf4" and getattr(s, "original_nested", s.nested) for s in states)
    assert results["fp32"] < 4  # learned: uniform would be 384
    for flag in ("load_in_4bit", "load_in_8bit"):
        assert results[flag] != results["fp32"] and abs(results[flag] / results["fp32"] - 1) < 0.05, results
    # docs/evaluation.md's table: pytest -s tests/evaluation/test_evaluation.py -k quantised_ppl
    print(f"\n{shape} on {device}: PPL fp32 {results['fp32']:.3f}, NF4 {results['load_in_4bit']:.3f}, "
          f"8-bit {results['load_in_8bit']:.3f}; NF4 kept unquantised: {', '.join(kept)}")


def test_4bit_leaves_the_layers_bitsandbytes_refuses_and_names_them(tmp_path, capsys, monkeypatch):
    """bitsandbytes 0.50 on an AVX512-BF16 CPU, emulated on any machine: its inference forward
    asserts on an output width not a multiple of 32. Those layers load in the model's dtype,
    one stderr line names them, the results JSON lists them, and the evaluation runs."""
    import bitsandbytes as bnb

    real = bnb.nn.Linear4bit.forward

    def forward(self, x):
        assert self.training or self.out_features % 32 == 0, "N must be divisible by block_n"
        return real(self, x)

    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", forward)
    data, out = tmp_path / "d.txt", tmp_path / "nf4.json"
    data.write_text("a few words of text to score " * 40)
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64", "--stride", "64",
                 "--load-in-4bit", "--output", str(out)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot quantise" in line]
    assert said == ["warning: --load-in-4bit: bitsandbytes " + bnb.__version__ + " cannot quantise 4 linear layer(s) "
                    "on cpu (N must be divisible by block_n); they stay in float32: model.layers.*.self_attn.k_proj (x2), "
                    "model.layers.*.self_attn.v_proj (x2)"]
    payload = json.loads(out.read_text())
    assert payload["config"]["unquantised_layers"] == ["lm_head"] + [f"model.layers.{i}.self_attn.{p}_proj"
                                                                    for i in (0, 1) for p in "kv"]
    assert math.isfinite(payload["results"][0]["ppl"])


def test_cli_end_to_end(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(6)))
    out, png = tmp_path / "ppl.json", tmp_path / "ppl.png"
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64,128", "--stride", "32",
                 "--num-windows", "4", "--method", "pi", "--output", str(out), "--plot", str(png)]) == 0
    payload = json.loads(out.read_text())
    assert [r["length"] for r in payload["results"]] == [64, 128] and payload["config"]["method"] == "pi"
    assert all(r["ppl"] > 1 and r["tokens"] > 0 and r["tokens_per_second"] > 0 for r in payload["results"])
    assert png.stat().st_size > 1000 and "| pi on tiny (random weights) | 64 |" in capsys.readouterr().out
    assert main(["eval", "plot", str(out), str(out), "--output", str(tmp_path / "two.png")]) == 0
    assert (tmp_path / "two.png").stat().st_size > 1000
    pk, heat = tmp_path / "pk.json", tmp_path / "pk.png"
    # a training pattern (re-prefill decoding) with a YAML-parsed --method-arg
    assert main(["eval", "passkey", "--model", "tiny", "--lengths", "300", "--depths", "0,1", "--trials", "2",
                 "--method", "sda", "--method-arg", "dilation=2", "--output", str(pk), "--heatmap", str(heat)]) == 0
    cells = json.loads(pk.read_text())["results"]
    assert [(c["length"], c["depth"], c["trials"], c["prompt_tokens"]) for c in cells] == [(300, 0.0, 2, 300), (300, 1.0, 2, 300)]
    assert cells[0]["keys"] == cells[1]["keys"] and len(cells[0]["outputs"]) == 2
    assert heat.stat().st_size > 1000 and "| 300 |" in capsys.readouterr().out


def test_dense_layers_attend_fully_and_the_others_run_the_pattern(tmp_path, capsys):
    """``eval --dense-layers``: every layer dense is full attention's PPL exactly, none is the
    pattern's, one layer dense is neither; the label names the layers."""
    from tests import ROOT

    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 100)

    def ppl(*flags: str) -> float:
        out = tmp_path / "r.json"
        assert main(["eval", "ppl", "--model", str(ROOT / "assets" / "tiny-base"), "--data", str(data), "--lengths", "128",
                     "--num-windows", "1", *flags, "--output", str(out), "--overwrite"]) == 0
        return json.loads(out.read_text())["results"][0]["ppl"]

    full, pattern = ppl("--method", "full"), ppl("--method", "s2")
    assert ppl("--method", "s2", "--dense-layers", "last 4") == full  # tiny-base has 4 layers
    assert ppl("--method", "s2", "--dense-layers", "") == pattern != full
    assert ppl("--method", "s2", "--dense-layers", "0") not in (full, pattern)
    assert "| s2 + full in [0] |" in capsys.readouterr().out


def test_bin_token_files_and_bad_input(tmp_path, capsys):
    from sparse_ft.data.token_files import write_token_file

    path = write_token_file(np.arange(3, 303) % 380, tmp_path / "t.bin", 384, "byt5")
    assert json.loads(path.with_suffix(".json").read_text())["dtype"] == "uint16"
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(path), "--lengths", "64", "--stride", "64"]) == 0
    capsys.readouterr()
    cases = [
        (["--data", str(path), "--lengths", "1000"], "--lengths 1000 longer than the 300 tokens"),
        (["--data", str(tmp_path / "missing.bin"), "--lengths", "64"], "does not exist"),
        (["--data", str(path), "--lengths", "64", "--method", "bogus"], "--method 'bogus' is unknown"),
        (["--data", str(path), "--lengths", "6x"], "must be a comma-separated list of integers"),
        (["--data", str(path), "--lengths", "64", "--method", "pi", "--method-arg", "alpha=2"], "--method pi: bad --method-arg"),
        (["--data", str(path), "--lengths", "64", "--method", "sda", "--method-arg", "w"], "must look like key=value"),
        (["--data", str(path), "--lengths", "64", "--method", "no-ppl"], "--method no-ppl cannot report perplexity: it answers questions"),
        (["--data", str(tmp_path / "missing.txt"), "--lengths", "64"], "does not exist"),
        (["--model", str(tmp_path / "nowhere"), "--data", str(path), "--lengths", "64"], "no such directory"),
    ]

    class NoPPL(methods.Method):
        name, supports = "no-ppl", methods.Supports(ppl=False, no_ppl_reason="it answers questions")

    methods.register(NoPPL)
    big = write_token_file(np.array([5, 900, 7] * 40), tmp_path / "big.bin", 70000, "other")
    cases.append((["--data", str(big), "--lengths", "64", "--data-dtype", "uint32"], "token id 900 >= the model's vocabulary size 384"))
    try:
        for extra, message in cases:
            assert main(["eval", "ppl", "--model", "tiny", *extra]) == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err and message in err, err
    finally:
        methods.METHODS.remove("no-ppl")


def test_token_files_need_no_tokenizer_and_any_utf8_file_is_text(tmp_path, capsys):
    from sparse_ft.data.token_files import write_token_file

    bare = tmp_path / "bare"  # weights and config only: no tokenizer files
    tiny_llama().save_pretrained(bare)
    tokens = write_token_file(np.arange(3, 303) % 380, tmp_path / "t.bin", 384, "byt5")
    assert main(["eval", "ppl", "--model", str(bare), "--data", str(tokens), "--lengths", "64", "--stride", "64"]) == 0
    text = "Call me Ishmael. Some years ago, never mind how long precisely. " * 4
    for name in ("notes.md", "LICENSE", "book.txt"):
        (tmp_path / name).write_text(text)
        assert main(["eval", "ppl", "--model", "tiny", "--data", str(tmp_path / name), "--lengths", "128", "--stride", "64"]) == 0
    assert "| full on tiny (random weights) | 128 |" in capsys.readouterr().out
    (tmp_path / "latin1.md").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    cases = [(["--model", str(bare), "--data", str(tmp_path / "notes.md")], "cannot load a tokenizer from"),
             (["--model", "tiny", "--data", str(tmp_path / "latin1.md")], "is not UTF-8 text (byte 3)")]
    for argv, message in cases:
        assert main(["eval", "ppl", *argv, "--lengths", "64"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_outputs_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from sparse_ft.evaluation import loading

    def load(*args, **kwargs):
        raise ValueError("the model loads")

    monkeypatch.setattr(loading, "load", load)
    (tmp_path / "file").write_text("")
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    cases = [["ppl", "--data", str(data), "--output", str(tmp_path / "file" / "r.json")],
             ["ppl", "--data", str(data), "--plot", str(tmp_path / "file" / "p.png")],
             ["ppl", "--data", str(data), "--output", str(tmp_path)],
             ["passkey", "--heatmap", str(tmp_path / "file" / "h.png")]]
    for argv in cases:
        assert main(["eval", argv[0], "--model", "tiny", "--lengths", "64", *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sparse-ft eval: error: --") and err.count("\n") == 1 and "model loads" not in err, err
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(data), "--output", str(tmp_path / "new" / "dir" / "r.json"),
                 "--lengths", "64"]) == 2
    assert "the model loads" in capsys.readouterr().err and (tmp_path / "new" / "dir").is_dir()  # made before it


def test_prepare_eval_and_adapter_evaluation(tmp_path, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    from sparse_ft.config import load_recipe
    from sparse_ft.modeling.model_io import read_meta
    from sparse_ft.train.trainer import train

    script = Path(__file__).resolve().parents[2] / "scripts" / "prepare_eval.py"
    spec = importlib.util.spec_from_file_location("prepare_eval", script)
    prepare_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_eval)
    text = tmp_path / "book.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 30)
    assert prepare_eval.main(["--tokenizer", "tiny", "--source", str(text), "--output", str(tmp_path / "book.bin")]) == 0
    assert np.fromfile(tmp_path / "book.bin", dtype=np.uint16).size == len(text.read_text()) + 1  # + EOS
    assert json.loads((tmp_path / "book.json").read_text())["tokens"] == len(text.read_text()) + 1
    assert prepare_eval.main(["--tokenizer", "tiny", "--source", str(tmp_path / "no.txt"), "--output", str(tmp_path / "x.bin")]) == 2
    assert "no.txt does not exist" in capsys.readouterr().err
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # a relative output directory: the adapter must record its base absolute
    train(load_recipe("tiny", ["train.output_dir=run", f"data.cache_dir={tmp_path / 'c'}", "deepspeed=null",
                               "train.max_steps=2", "train.report_to=[none]"]))
    base = str(run / "base-model")
    meta = read_meta(run / "adapter")
    assert (meta["base_model"], meta["base_model_given"]) == (base, "tiny")
    monkeypatch.chdir(tmp_path / "c")  # elsewhere: merge finds the base from the adapter alone
    assert main(["merge", "--adapter", str(run / "adapter"), "--output", "merged"]) == 0
    assert (tmp_path / "c" / "merged" / "model.safetensors").is_file()
    assert main(["eval", "ppl", "--model", base, "--adapter", str(run / "adapter"), "--data", str(tmp_path / "book.bin"),
                 "--lengths", "512", "--stride", "256", "--output", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["results"][0]["tokens"] > 0
    # the adapter's trained RoPE (linear x2 to 512) is in place, and pi composes with it
    from sparse_ft.modeling import rope
    from sparse_ft.evaluation import loading

    model, _ = loading.load(base, str(run / "adapter"))
    config = model.get_base_model().config
    assert (rope.rope_parameters(config)["factor"], config.max_position_embeddings) == (2.0, 512)
    methods.get("pi").apply(model, 1024)
    assert (rope.rope_parameters(config)["factor"], config.max_position_embeddings) == (4.0, 1024)
    other = tmp_path / "other"
    tiny_llama(hidden_size=128, intermediate_size=256).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(other), "--adapter", str(run / "adapter"), "--data", str(tmp_path / "book.bin"),
                 "--lengths", "64"]) == 2
    assert "was trained on a base with hidden_size=64, but" in capsys.readouterr().err


def test_a_device_that_is_not_here_fails_before_loading(tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text("text " * 100)
    args = ["eval", "ppl", "--model", "tiny", "--data", str(data), "--lengths", "64", "--load-in-4bit", "--device"]
    assert main(args + ["cdua"]) == 2
    assert "--device 'cdua' is not a device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(args + ["cuda:0"]) == 2
    assert "--device 'cuda:0': torch sees no CUDA device here" in capsys.readouterr().err
