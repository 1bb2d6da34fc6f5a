"""``sparse-ft generate``: the completion on stdout is ``model.generate``'s, greedy and
sampled; a left-padded batch gives each prompt what it gets alone; prompts from arguments, a
file, JSON lines and stdin are the same prompts; an adapter loads through eval's path, its
RoPE restored. Bad inputs are rows of tests/config/test_bad_inputs.py's ``CLI_CASES``."""

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sparse_ft import methods, use_attention
from sparse_ft.cli import main
from sparse_ft.evaluation.generate import escape_line_breaks
from sparse_ft.evaluation.prompt_tokens import leading_specials, token_ids
from sparse_ft.modeling import rope

BASE = Path(__file__).resolve().parents[2] / "assets" / "tiny-base"
PROMPTS = ["def f():", "import os\nfrom pathlib import Path\n\n\ndef main(argv):\n    "]
NEW = 12
DCA = {"chunk_size": 24, "local_window": 4, "pretraining_length": 32}  # small: the prompts cross chunks


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BASE)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(BASE).eval()


def reference(model, tokenizer, prompt: str, **decoding) -> str:
    """transformers' generate on the prompt alone, as a user would call it."""
    ids = torch.tensor([leading_specials(tokenizer) + token_ids(tokenizer, prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, pad_token_id=0,
                             **({"do_sample": False} | decoding))
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def generate(capsys, *argv: str) -> list[str]:
    """stdout of ``sparse-ft generate`` on the tiny base, one line per prompt; it holds nothing else."""
    assert main(["generate", "--model", str(BASE), "--max-new-tokens", str(NEW), *argv]) == 0
    return capsys.readouterr().out.removesuffix("\n").split("\n")


def test_greedy_completion_is_model_generates_and_alone_on_stdout(model, tokenizer, capsys):
    expected = reference(model, tokenizer, PROMPTS[0])
    assert "\n" in expected  # streamed as it is: a single prompt's completion keeps its newlines
    assert main(["generate", "--model", str(BASE), "--max-new-tokens", str(NEW), PROMPTS[0]]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("name", ["full", "dca"])
def test_a_padded_batch_gives_each_prompt_what_it_gets_alone(model, tokenizer, capsys, tmp_path, name):
    params = DCA if name == "dca" else {}
    use_attention(model, methods.get(name, **params))
    alone = [reference(model, tokenizer, prompt) for prompt in PROMPTS]
    use_attention(model, "full")
    lengths = [len(token_ids(tokenizer, p)) for p in PROMPTS]
    assert lengths[0] != lengths[1]
    out = tmp_path / "out.jsonl"
    flags = [f"--method-arg={k}={v}" for k, v in params.items()]
    assert generate(capsys, "--method", name, *flags, "--batch-size", "2", "--output", str(out), *PROMPTS) == \
        [escape_line_breaks(text) for text in alone]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion"] for r in rows] == alone and [r["prompt"] for r in rows] == PROMPTS
    assert [r["prompt_tokens"] for r in rows] == lengths and rows[0]["sparse_ft_output"] == "sparse-ft generate"
    # the file is sparse-ft's: replaced with --overwrite only
    assert main(["generate", "--model", str(BASE), "--output", str(out), "x"]) == 2
    assert "pass --overwrite to replace it" in capsys.readouterr().err


def test_sampling_is_model_generates_with_the_same_seed(model, tokenizer, capsys):
    torch.manual_seed(7)
    expected = reference(model, tokenizer, PROMPTS[0], do_sample=True, temperature=0.7, top_p=0.9, top_k=0)
    assert main(["generate", "--model", str(BASE), "--max-new-tokens", str(NEW), "--temperature", "0.7", "--top-p", "0.9",
                 "--seed", "7", PROMPTS[0]]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_prompts_from_a_file_json_lines_and_stdin_are_the_arguments(tmp_path, capsys, monkeypatch):
    expected = generate(capsys, "x = 1", "class A:")
    (tmp_path / "p.txt").write_text("x = 1\n\nclass A:\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x = 1"}\n{"prompt": "class A:"}\n')
    assert generate(capsys, "--file", str(tmp_path / "p.txt")) == expected
    assert generate(capsys, "--file", str(tmp_path / "p.jsonl")) == expected
    monkeypatch.setattr("sys.stdin", io.StringIO("x = 1\r\nclass A:\r\n"))
    assert generate(capsys, "--file", "-") == expected


def test_an_adapter_loads_through_evals_path_with_its_rope(tmp_path, model, tokenizer, capsys):
    """LoRA weights that change the model and a RoPE of linear x2: the completion is that of
    the base with the adapter's RoPE and PEFT's adapter, built by hand."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from sparse_ft.modeling.weight_files import fingerprint

    adapter = tmp_path / "adapter"
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(BASE), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, weight in peft.named_parameters():
        if "lora_B" in name:
            weight.data.normal_(std=0.5)
    peft.save_pretrained(adapter)
    config = AutoConfig.from_pretrained(BASE)
    rope.scale_rope(config, 2.0, "linear")
    (adapter / "sparse_ft.json").write_text(json.dumps({
        "base_model": str(BASE), "base_model_given": str(BASE), "base_fingerprint": fingerprint(BASE),
        "rope_parameters": rope.rope_parameters(config), "max_position_embeddings": config.max_position_embeddings}))
    by_hand = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE, config=config), str(adapter)).eval()
    expected = [reference(by_hand, tokenizer, prompt) for prompt in PROMPTS]
    assert expected != [reference(model, tokenizer, prompt) for prompt in PROMPTS]  # the adapter is at work
    assert main(["generate", "--adapter", str(adapter), "--max-new-tokens", str(NEW), *PROMPTS]) == 0
    assert capsys.readouterr().out.removesuffix("\n").split("\n") == [escape_line_breaks(text) for text in expected]


def test_parallelcomp_answers_a_prompt_about_its_context(tmp_path, capsys):
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"context": "The pass key is 12345. " * 8, "prompt": " The pass key is"}) + "\n")
    lines = generate(capsys, "--method", "parallelcomp", "--method-arg", "chunk_size=64", "--file", str(rows))
    assert len(lines) == 1


def test_dense_layers_run_full_attention_in_those_layers(capsys, tmp_path):
    """``generate --dense-layers`` as ``eval``'s: a pattern with every layer dense answers as full
    attention does, with none as the pattern alone; the JSON lines name the layers."""
    prompt = "x = 1\n" * 40  # longer than s2's group: the pattern differs from full attention
    full = generate(capsys, prompt)
    args = ("--method", "s2")
    assert generate(capsys, *args, "--dense-layers", "last 4", "--output", str(tmp_path / "g.jsonl"), prompt) == full
    assert json.loads((tmp_path / "g.jsonl").read_text())["method"] == "s2 + full in last 4"
    assert generate(capsys, *args, "--dense-layers", "", prompt) == generate(capsys, *args, prompt) != full
