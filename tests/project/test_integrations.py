"""docs/integrations.md runs as written: its code blocks are read from the page, the first
(the model) then each trainer's, in a directory holding the repository's tiny base and data,
so the page and what is tested cannot drift apart."""

import re
from pathlib import Path

import pytest
import torch

from sparse_ft.modeling.attention import current_method
from sparse_ft.modeling.rope import rope_parameters

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "integrations.md"


def code_blocks() -> dict[str, str]:
    """The page's ```python blocks, keyed by the heading above each."""
    blocks, heading = {}, None
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", PAGE.read_text(), re.M | re.S):
        if match.group(1):
            heading = match.group(1)
        else:
            assert heading not in blocks, f"two code blocks under {heading!r}: give the second its own heading"
            blocks[heading] = match.group(2)
    return blocks


BLOCKS = code_blocks()
MODEL = "The model"
CHAT = "TRL's SFTTrainer on chat rows"


def test_the_page_has_the_model_and_every_trainer():
    assert list(BLOCKS) == [MODEL, "transformers' Trainer", "TRL's SFTTrainer with packing", CHAT,
                            "Plain PEFT, your own loop"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in ("assets", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_block(name: str) -> dict:
    """The model's block, then ``name``'s, in one namespace; ``trained`` lists the trainable
    weights that moved."""
    namespace: dict = {}
    exec(compile(BLOCKS[MODEL], f"{PAGE}:{MODEL}", "exec"), namespace)
    model = namespace["model"]
    assert current_method(model).name == "scca_flow"
    assert rope_parameters(model.config)["factor"] == 4.0 and model.config.max_position_embeddings == 1024
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    exec(compile(BLOCKS[name], f"{PAGE}:{name}", "exec"), namespace)
    namespace["trained"] = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    return namespace


# every kind of weight LoRA+ trains: LoRA's, the embeddings', the norms'
TRAINED = ("q_proj", "embed_tokens", "input_layernorm", "model.norm")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformers' Trainer", "TRL's SFTTrainer with packing"])
def test_a_trainer_block_trains_the_extended_model_through_the_pattern(name, workdir):
    namespace = run_block(name)
    assert current_method(namespace["model"]).name == "scca_flow"
    for part in TRAINED:
        assert any(part in n for n in namespace["trained"]), f"{part} did not train"
    state = namespace["trainer"].state
    assert state.global_step == 3 and torch.isfinite(torch.tensor(state.log_history[-1]["train_loss"]))


@pytest.mark.slow
def test_trl_on_chat_rows_trains_on_the_targets_data_format_chat_takes(workdir):
    """TRL's labels (completion_only_loss, packed) are, row for row and token for token, the
    targets data.format: chat takes from the same rows and template; each packed row's positions
    restart at every conversation; the extended model trains through the pattern."""
    import json
    from types import SimpleNamespace

    from sparse_ft.data.conversations import Renderer, tokenize

    namespace = run_block(CHAT)
    trainer, tokenizer = namespace["trainer"], namespace["tokenizer"]
    assert trainer.state.global_step == 2 and current_method(namespace["model"]).name == "scca_flow"
    for part in TRAINED:
        assert any(part in n for n in namespace["trained"]), f"{part} did not train"
    rows = [json.loads(line) for line in (workdir / "data" / "tiny" / "chat.jsonl").read_text().splitlines()]
    render = Renderer(SimpleNamespace(format="chat", chat_template=tokenizer.chat_template), tokenizer)
    ours = [(ids, [t if target else -100 for t, target in zip(ids, mask)])
            for ids, mask in tokenize([render(f"row {i}", row) for i, row in enumerate(rows)], tokenizer)]
    theirs = []
    for packed in trainer.train_dataset:
        ends = torch.tensor(packed["seq_lengths"]).cumsum(0).tolist()
        theirs += [(packed["input_ids"][a:b], packed["labels"][a:b]) for a, b in zip([0, *ends], ends)]
    assert sorted(theirs) == sorted(ours)
    assert sum(t != -100 for _, labels in ours for t in labels) == 2240  # as docs/integrations.md says
    packed = trainer.train_dataset[0]
    batch = trainer.data_collator([packed])
    assert (batch["position_ids"] == 0).sum() == len(packed["seq_lengths"]) >= 2


@pytest.mark.slow
def test_the_peft_block_trains_and_saves_a_model_at_its_new_length(workdir):
    """The merged model differs from the base in every kind of trained weight, and reloads
    from its directory at 1024 tokens with the same logits."""
    from transformers import AutoModelForCausalLM

    namespace = run_block("Plain PEFT, your own loop")
    assert namespace["batch"]["input_ids"].shape[0] == 1 and (namespace["batch"]["position_ids"] == 0).sum() == 8
    base = dict(AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-base").named_parameters())
    merged = namespace["merged"]
    for part in TRAINED:
        assert any(part in n and not torch.equal(p, base[n]) for n, p in merged.named_parameters()), f"{part} did not train"
    saved = AutoModelForCausalLM.from_pretrained(workdir / "runs" / "peft-merged")
    assert rope_parameters(saved.config)["rope_type"] == "linear" and saved.config.max_position_embeddings == 1024
    ids = namespace["batch"]["input_ids"][:, :64]
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, merged(ids).logits)
