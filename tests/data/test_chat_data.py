"""Supervised fine-tuning data (``data.format: chat | instruction``): the loss trains on exactly
the answer tokens (those TRL's assistant_only_loss takes from a marked template), rows are
packed whole and padding-free so a packed sample gives each conversation what it gets alone
(loss and gradients), rows too long are left out and counted, the labels travel through the
cache and into the checkpoint's data identity, train.py runs on chat rows end to end, and a chat
run stopped after a checkpoint resumes to the same losses. Bad rows and templates are rows of
test_bad_inputs.py's CASES."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.train.helpers_train import curve, one_thread, overrides, train_py, write_held_out  # noqa: F401
from sparse_ft import use_attention
from sparse_ft.data import packing
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.data.turn_packing import START, TARGET, TurnBlocks
from sparse_ft.modeling.tiny import tiny_tokenizer
from tests.modeling.test_attention_integration import build, pattern_of

# ChatML-like, for the byte tokenizer of the tiny model, which has no chat template of its own
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def cfg(tmp_path, source, **kw):
    base = dict(source=str(source), split="train", text_column="text", min_tokens=1, cache_dir=str(tmp_path / "cache"),
                streaming=False, max_documents=None, packing="blocks", format="chat", chat_template=TEMPLATE)
    return SimpleNamespace(**{**base, **kw})


def conversation(i):
    turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
    for k in range(1 + i % 2):  # one or two exchanges
        turns += [{"role": "user", "content": f"What is {i} times {k + 2}?"},
                  {"role": "assistant", "content": f"{i} times {k + 2} is {i * (k + 2)}."}]
    return {"messages": turns}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def answers_of(sample):
    return [t for t, label in zip(sample["input_ids"].tolist(), sample["labels"].tolist()) if label != -100]


def test_the_loss_trains_on_exactly_the_assistant_tokens(tmp_path):
    tok = tiny_tokenizer()
    rows = [conversation(i) for i in range(12)]
    ds = build_train_dataset(cfg(tmp_path, write_rows(tmp_path / "c.jsonl", rows)), tok, seq_len=256)
    expected = [tok(m["content"] + "<|end|>\n", add_special_tokens=False).input_ids
                for row in rows for m in row["messages"] if m["role"] == "assistant"]
    got = [t for i in range(len(ds)) for t in answers_of(ds[i])]
    assert got == [t for answer in expected for t in answer]  # each answer and its end-of-turn, in order, nothing else
    meta = packing.load_meta(ds)
    assert meta["targets"] == len(got) and meta["kept"] == 12 and meta["cache_format"] == 3
    for i in range(len(ds)):  # every sample starts a conversation; positions restart at each
        sample = ds[i]
        assert sample["position_ids"][0] == 0 and len(sample["input_ids"]) == 256


def test_the_answers_are_the_tokens_trls_assistant_only_loss_takes():
    """TRL's assistant_only_loss labels the tokens transformers' return_assistant_tokens_mask
    marks between a template's {% generation %} marks; that needs a fast tokenizer, so the tiny
    model's bytes are given one (the same ids). On multi-turn rows, with the marked template,
    its mask is the one the renderer finds turn by turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from sparse_ft.data.conversations import Renderer, tokenize

    slow, chars = tiny_tokenizer(), bytes_to_unicode()
    core = Tokenizer(models.BPE(vocab={chars[b]: b + 3 for b in range(256)}, merges=[]))  # ByT5: byte b is id b + 3
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=core)
    marked = TEMPLATE.replace("{{ m.content }}<|end|>\n", "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                              "<|end|>\n{% endgeneration %}{% else %}{{ m.content }}<|end|>\n{% endif %}")
    rows = [conversation(i) for i in range(6)]
    render = Renderer(SimpleNamespace(format="chat", chat_template=marked), slow)
    for row, (ids, mask) in zip(rows, tokenize([render(f"row {i}", row) for i, row in enumerate(rows)], slow)):
        theirs = fast.apply_chat_template(row["messages"], chat_template=marked, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert theirs["input_ids"] == ids and theirs["assistant_masks"] == [int(m) for m in mask]


def test_instruction_rows_train_on_the_output_and_eos(tmp_path):
    tok = tiny_tokenizer()
    rows = [{"instruction": "Summarise.", "input": "A long text.", "output": "Short."},
            {"instruction": "[INST] Say hi [/INST]", "output": "hi"}, {"instruction": "Count.", "input": "", "output": "1 2"}]
    ds = build_train_dataset(cfg(tmp_path, write_rows(tmp_path / "i.jsonl", rows), format="instruction", chat_template=None),
                             tok, seq_len=128)
    sample = ds[0]
    ids = sample["input_ids"].tolist()
    eos = tok.eos_token_id
    text = tok.decode([t for t in ids if t != eos and t != tok.pad_token_id])
    assert text == "Summarise.\n\nA long text.Short.[INST] Say hi [/INST]hiCount.1 2"  # the prompt rule: instruction[\n\ninput]
    out = lambda s: tok(s, add_special_tokens=False).input_ids + [eos]  # noqa: E731
    assert answers_of(sample) == out("Short.") + out("hi") + out("1 2")


def test_rows_are_packed_whole_and_rows_too_long_are_left_out(tmp_path, capsys):
    tok = tiny_tokenizer()
    rows = [conversation(i) for i in range(6)] + [{"messages": [{"role": "user", "content": "x" * 300},
                                                                {"role": "assistant", "content": "y"}]}]
    ds = build_train_dataset(cfg(tmp_path, write_rows(tmp_path / "c.jsonl", rows)), tok, seq_len=200)
    err = capsys.readouterr().err
    assert "of 7 chat rows, kept 6" in err and "left out 1 longer than data.seq_len=200 tokens" in err
    rendered = [len(tok(tok.apply_chat_template(r["messages"], chat_template=TEMPLATE, tokenize=False),
                        add_special_tokens=False).input_ids) for r in rows[:6]]
    expected, used = [], 0  # whole rows in order; a row that does not fit starts the next sample, filler before it
    for n in rendered:
        if used + n > 200:
            expected.append(200 - used)
            used = 0
        expected.append(n)
        used = (used + n) % 200
    expected += [200 - used] if used else []
    lengths = []  # the documents of every sample, filler included
    for i in range(len(ds)):
        starts = (ds[i]["position_ids"] == 0).nonzero().flatten().tolist() + [200]
        lengths += [b - a for a, b in zip(starts, starts[1:])]
    assert lengths == expected


def test_the_labels_travel_through_the_cache_and_a_damaged_flags_file_is_rebuilt(tmp_path, capsys):
    tok = tiny_tokenizer()
    config = cfg(tmp_path, write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(8)]))
    first = build_train_dataset(config, tok, seq_len=128)
    samples = [first[i] for i in range(len(first))]
    flags = first.path.with_suffix(".flags")
    flags.write_bytes(bytes(len(flags.read_bytes())))  # the same size, the labels gone
    again = build_train_dataset(config, tok, seq_len=128)
    assert "its flags file's sha256 differs" in capsys.readouterr().err
    assert all(torch.equal(a["labels"], again[i]["labels"]) for i, a in enumerate(samples))
    other = build_train_dataset(cfg(tmp_path, config.source, chat_template=TEMPLATE.replace("<|end|>", "<|eot|>")), tok, 128)
    assert other.path != first.path  # another template, another cache
    # the checkpoint's data identity covers the labels: the same tokens with other targets differ
    ids = torch.tensor([[5, 6, 7, 8]]).numpy()
    assert (TurnBlocks(ids, torch.tensor([[START, TARGET, 0, 0]], dtype=torch.uint8).numpy()).sha256()
            != TurnBlocks(ids, torch.tensor([[START, TARGET, TARGET, 0]], dtype=torch.uint8).numpy()).sha256())


@pytest.mark.parametrize("name", ["scca_flow", "s2"])
def test_a_packed_sample_trains_each_conversation_as_it_would_alone(tmp_path, name):
    """The loss summed over a packed sample's targets, and its gradients, are each conversation's
    alone summed: nothing crosses between conversations, and the filler adds nothing."""
    tok = tiny_tokenizer()
    ds = build_train_dataset(cfg(tmp_path, write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(5)])), tok, 256)
    sample = ds[0]
    ids, labels, positions = sample["input_ids"], sample["labels"], sample["position_ids"]
    starts = (positions == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3  # several conversations (and the filler) in the sample
    model = use_attention(build("llama").double(), pattern_of(name))

    def loss_and_grad(ids, labels, **kwargs):
        model.zero_grad()
        logits = model(ids[None], **kwargs).logits[0]
        loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        loss.backward()
        return loss.detach(), model.get_input_embeddings().weight.grad.clone()

    packed = loss_and_grad(ids, labels, position_ids=positions[None])
    alone = [loss_and_grad(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:] + [len(ids)])]
    torch.testing.assert_close(packed[0], sum(loss for loss, _ in alone))
    torch.testing.assert_close(packed[1], sum(grad for _, grad in alone))


def test_train_py_fine_tunes_on_chat_rows(tmp_path):
    """The command a user types, on chat rows (with a template: the tiny tokenizer has none),
    validating at the end on held-out text."""
    rows = [{"messages": conversation(i)["messages"] + [{"role": "user", "content": "And in words?"},
                                                       {"role": "assistant", "content": f"number {i}"}]} for i in range(24)]
    source = write_rows(tmp_path / "chat.jsonl", rows)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)  # a file: "{%" on the command line would be YAML
    code = train_py("recipe=tiny", "deepspeed=null", "train.max_steps=2", f"data.source={source}", "data.format=chat",
                    f"data.chat_template={tmp_path / 'chat.jinja'}", f"train.output_dir={tmp_path / 'run'}",
                    f"data.cache_dir={tmp_path / 'cache'}", "train.report_to=[none]", "validation.at_end=true",
                    f"validation.data={write_held_out(tmp_path / 'held.jsonl')}", "validation.lengths=[256]")
    assert code == 0
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert sum("loss" in record for record in log) >= 2
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_a_chat_run_stopped_after_a_checkpoint_resumes_to_the_same_losses(tmp_path, capsys):
    """recipes/tiny_chat.yaml on its shipped rows: its step-2 checkpoint alone (what a run killed
    after step 2 leaves) resumes to the uninterrupted run's losses and adapter, bit for bit."""
    from safetensors.torch import load_file

    from sparse_ft.config import load_recipe
    from sparse_ft.train.trainer import train

    def run(out):
        return train(load_recipe("tiny_chat", overrides(out, tmp_path / "cache", "deepspeed=null", "train.max_steps=4",
                                                        "train.save_steps=2", "train.save_total_limit=10")))

    full = run(tmp_path / "full")
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    capsys.readouterr()
    resumed = run(tmp_path / "resumed")
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert len(curve(full)) == 4 and curve(resumed) == curve(full)
    adapters = [load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("full", "resumed")]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(v, adapters[1][k]) for k, v in adapters[0].items())
