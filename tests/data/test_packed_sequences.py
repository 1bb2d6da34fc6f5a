"""Padding-free packing: documents laid end to end in one row, position ids restarting at
each (transformers' DataCollatorWithFlattening, TRL's padding_free) or flash-attention's
cu_seq_lens. Every pattern and algorithm gives each document what it gives that document
alone, values and gradients, and nothing crosses from one document to another."""

import json
import math

import pytest
import torch

from tests.train.helpers_train import common, one_thread  # noqa: F401
from sparse_ft import methods, use_attention
from sparse_ft.methods.sequences import find_spans
from tests.modeling.test_attention_integration import NAMES, build, ids_of, pattern_of

# a document of one token, ones shorter than a chunk, two pairs of equal length (batched
# together), none a multiple of a chunk, the longest past DCA's and LongHeads' windows
LENGTHS = [1, 5, 13, 5, 29, 13]


def restarting(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def cu_seq_lens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def logits_and_grad(model, ids, **kwargs):
    model.zero_grad()
    logits = model(ids, **kwargs).logits
    (logits.float() ** 2).sum().backward()  # a sum over tokens: the packed row's is the documents' sum
    return logits.detach()[0], model.get_input_embeddings().weight.grad.clone()


@pytest.fixture(scope="module")
def model():
    return build("qwen2")  # grouped-query attention


@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_equal_each_document_alone(model, name):
    use_attention(model, pattern_of(name))
    ids = ids_of((1, sum(LENGTHS)))
    packed, packed_grad = logits_and_grad(model, ids, position_ids=restarting(LENGTHS))
    alone = [logits_and_grad(model, part[None]) for part in ids[0].split(LENGTHS)]
    torch.testing.assert_close(packed, torch.cat([logits for logits, _ in alone]), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(packed_grad, sum(grad for _, grad in alone), atol=1e-5, rtol=1e-4)
    # flash-attention's keywords (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) cut it the same way
    with torch.no_grad():
        cu = {"cu_seq_lens_q": cu_seq_lens(LENGTHS), "cu_seq_lens_k": cu_seq_lens(LENGTHS),
              "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}
        by_cu = model(ids, position_ids=restarting(LENGTHS), **cu).logits[0]
    torch.testing.assert_close(by_cu, packed, atol=2e-6, rtol=1e-5)
    use_attention(model, "full")


@pytest.mark.parametrize("name", NAMES)
def test_changing_one_document_changes_no_other(model, name):
    use_attention(model, pattern_of(name))
    ids = ids_of((1, sum(LENGTHS)))
    positions = restarting(LENGTHS)
    with torch.no_grad():
        base = model(ids, position_ids=positions).logits[0]
        changed = ids.clone()
        changed[0, 6:19] = ids_of((13,), 7)  # the third document, 13 tokens
        after = model(changed, position_ids=positions).logits[0]
    assert not torch.allclose(after[6:19], base[6:19])
    torch.testing.assert_close(after[:6], base[:6], atol=0, rtol=0)
    torch.testing.assert_close(after[19:], base[19:], atol=0, rtol=0)
    use_attention(model, "full")


def test_packed_rows_with_padding_and_two_rows():
    """Two rows of packed documents, the second right-padded: each document still alone."""
    model = use_attention(build("llama"), "scca_flow")
    first, second = [7, 20, 9], [11, 14]
    ids = ids_of((2, 36))
    positions = torch.cat([restarting(first), torch.cat([restarting(second), torch.zeros(1, 11, dtype=torch.long)], 1)])
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        packed = model(ids, attention_mask=mask, position_ids=positions).logits
        for row, lengths in ((0, first), (1, second)):
            alone = torch.cat([model(part[None]).logits[0] for part in ids[row, : sum(lengths)].split(lengths)])
            torch.testing.assert_close(packed[row, : sum(lengths)], alone, atol=2e-6, rtol=1e-5)


def test_spans_and_bad_cu_seq_lens():
    positions = restarting([3, 2, 4])
    spans = find_spans(None, {"position_ids": positions}, batch=1, q_len=9, kv_len=9, owner="x")
    assert (spans.rows, spans.begins, spans.lengths) == ([0, 0, 0], [0, 3, 5], [3, 2, 4])
    assert torch.equal(spans.local_positions(), positions)
    assert find_spans(None, {"position_ids": torch.arange(9)[None]}, batch=1, q_len=9, kv_len=9, owner="x") is None
    with pytest.raises(ValueError, match=r"x: cu_seq_lens=\[0, 4, 8\] are not the cumulative lengths of the documents "
                                         r"in 1 row\(s\) of 9 tokens"):
        find_spans(None, {"cu_seq_lens_k": torch.tensor([0, 4, 8])}, batch=1, q_len=9, kv_len=9, owner="x")
    with pytest.raises(ValueError, match="a document across two rows"):
        find_spans(None, {"cu_seq_lens_k": torch.tensor([0, 3, 6, 10])}, batch=2, q_len=5, kv_len=5, owner="x")
    with pytest.raises(ValueError, match="while decoding 1 queries against a KV cache of 9 keys"):
        find_spans(None, {"cu_seq_lens_k": torch.tensor([0, 9])}, batch=1, q_len=1, kv_len=9, owner="x")


def test_padding_inside_a_document_is_refused():
    model = use_attention(build("llama"), "s2")
    ids = ids_of((1, 24))
    holes = torch.ones_like(ids)
    holes[0, 10:12] = 0
    with pytest.raises(ValueError, match="padding between the real tokens of one sequence"):
        model(ids, attention_mask=holes)


def test_transformers_flattening_collator_trains_through_a_pattern(tmp_path):
    """transformers' DataCollatorWithFlattening (what TRL's padding_free builds on) with
    ``use_attention(model, "scca_flow")``: the packed loss is the documents' losses alone,
    token-weighted, and transformers' Trainer with gradient checkpointing lowers it."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = use_attention(build("llama"), "scca_flow").train()
    documents = [{"input_ids": ids_of((n,), seed).tolist()} for seed, n in enumerate([37, 5, 64, 1, 19])]
    for flash_kwargs in (False, True):  # position ids alone, or with cu_seq_lens
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(documents)
        assert ("cu_seq_lens_q" in batch) == flash_kwargs
        with torch.no_grad():
            packed = model(**batch).loss
            alone = [(model(input_ids=torch.tensor([d["input_ids"]]), labels=torch.tensor([d["input_ids"]])).loss,
                      len(d["input_ids"]) - 1) for d in documents if len(d["input_ids"]) > 1]
        torch.testing.assert_close(packed, sum(loss * n for loss, n in alone) / sum(n for _, n in alone),
                                   atol=1e-5, rtol=1e-5)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=5, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=documents, data_collator=DataCollatorWithFlattening())
    trainer.train()
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_padding_free_samples_restart_positions_after_each_eos():
    from sparse_ft.data.packing import TokenBlocks

    eos = 1
    sample = TokenBlocks(torch.tensor([[5, 6, eos, 7, eos, eos, 8, 9]]).numpy(), restart_after=eos)[0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert sample["labels"].tolist() == [5, 6, eos, -100, eos, -100, -100, 9]  # the first is no target anyway
    assert set(TokenBlocks(torch.tensor([[5, eos, 7]]).numpy())[0]) == {"input_ids", "labels"}  # blocks: as before


def test_the_trainer_trains_padding_free(tmp_path, common, monkeypatch):
    """``data.packing=padding_free``: the documents of a sample reach the pattern as documents."""
    from sparse_ft.config import load_recipe
    from sparse_ft.methods import pattern
    from sparse_ft.train.trainer import train

    documents = []

    def recording(*args, **kwargs):
        spans = find_spans(*args, **kwargs)
        documents.append(0 if spans is None else len(spans.rows))
        return spans

    monkeypatch.setattr(pattern, "find_spans", recording)
    source = tmp_path / "short.jsonl"  # documents of 40-200 tokens, several per sample of 512
    source.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (8 + i % 37)}) + "\n" for i in range(64)))
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={tmp_path / 'run'}", "data.packing=padding_free",
                                         f"data.source={source}", "data.min_tokens=0", "train.max_steps=2",
                                         "train.gradient_accumulation_steps=1"]))
    assert len(summary["history"]) == 2 and all(math.isfinite(r["loss"]) for r in summary["history"])
    assert max(documents) > 1


def test_padding_free_samples_without_a_target_are_skipped():
    """Issue 31: a sample of empty documents only (EOS after EOS) has no target; so has one
    whose only non-EOS token starts a document. Both are left out of the dataset, counted."""
    import numpy as np

    from sparse_ft.data.packing import TokenBlocks

    eos = 1
    samples = np.array([[5, 6, eos, 7], [eos, eos, eos, eos], [eos, 8, eos, eos], [eos, eos, eos, 9]])
    packed = TokenBlocks(samples, restart_after=eos)
    assert packed.skipped == 2 and len(packed) == 2
    assert [packed[i]["input_ids"].tolist() for i in range(2)] == [samples[0].tolist(), samples[2].tolist()]
    assert all((packed[i]["labels"][1:] != -100).any() for i in range(2))
    blocks = TokenBlocks(samples)  # blocks: every token after the first is a target
    assert blocks.skipped == 0 and len(blocks) == 4


def test_a_sample_without_a_target_takes_no_optimizer_step(tmp_path, common, capsys):
    """Blank rows kept on purpose (data.min_tokens=0) make a padding-free sample of EOS only: it
    is skipped with a count on stderr, so the epoch's steps, optimizer steps and schedule are
    those of the three samples with targets, each with a loss and a gradient."""
    from sparse_ft.config import load_recipe
    from sparse_ft.train import checkpoint
    from sparse_ft.train.trainer import train

    source = tmp_path / "blank.jsonl"  # 2,302 tokens: samples 0, 1 and 3 of 512 hold text, sample 2 only EOS
    rows = [{"text": "word " * 120}, *[{"text": ""}] * 1100, {"text": "word " * 120}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    summary = train(load_recipe("tiny", [*common, f"train.output_dir={out}", "data.packing=padding_free",
                                         f"data.source={source}", "data.min_tokens=0", "train.max_steps=-1",
                                         "train.gradient_accumulation_steps=1", "train.save_steps=100"]))
    err = capsys.readouterr().err
    assert "1100 blank (kept: data.min_tokens=0)" in err
    assert "data: skipped 1 of 4 samples: no target in them" in err
    assert summary["steps"] == len(summary["history"]) == 3
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in summary["history"])
    assert checkpoint.read_meta(checkpoint.directory(out, 3))["optimizer_steps"] == 3


def _flash_attn_varlen_func_as_documented(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                                          causal=False, softmax_scale=None, **kwargs):
    """flash-attn's flash_attn_varlen_func semantics from its README: (total, heads, dim)
    tokens of sequences laid end to end at cu_seqlens, fewer K/V heads allowed, causal inside
    each sequence only."""
    assert cu_seqlens_q.dtype == torch.int32 and int(max_seqlen_q) == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for lo, hi in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        keys, values = (x[lo:hi].repeat_interleave(groups, dim=1) for x in (k, v))
        scores = torch.einsum("ihd,jhd->hij", q[lo:hi], keys) * softmax_scale
        visible = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril() if causal else torch.ones(hi - lo, hi - lo, dtype=torch.bool)
        out[lo:hi] = torch.einsum("hij,jhd->ihd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    return out


def test_causal_on_flash_runs_packed_documents_in_one_varlen_call(model, monkeypatch):
    """On CUDA the pattern ``causal`` with backend flash computes a packed row with flash-attn's
    varlen kernel, one call per layer; here through a stand-in with its documented semantics."""
    import sys
    import types

    from attn_patterns import patterns

    calls = []

    def varlen(*args, **kwargs):
        calls.append(args[3].tolist())
        return _flash_attn_varlen_func_as_documented(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setattr(patterns, "resolve_backend", lambda backend, q: backend or "sdpa")  # CPU tensors pass
    use_attention(model, "causal", backend="flash")
    ids = ids_of((1, sum(LENGTHS)))
    with torch.no_grad():
        packed = model(ids, position_ids=restarting(LENGTHS)).logits[0]
    assert calls == [cu_seq_lens(LENGTHS).tolist()] * model.config.num_hidden_layers
    use_attention(model, "causal")
    with torch.no_grad():
        alone = torch.cat([model(part[None]).logits[0] for part in ids[0].split(LENGTHS)])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-5)
    use_attention(model, "full")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_packed_documents_on_cuda_equal_each_document_alone(name):
    """On the GPU in bf16 (flash-attn's varlen kernel for ``causal`` with backend flash where
    installed): every pattern and algorithm, a packed row against each document alone."""
    model = build("qwen2").cuda().to(torch.bfloat16)
    backend = {"backend": "flash"} if name == "causal" and _flash_installed() else {}
    use_attention(model, pattern_of(name) if not backend else methods.get(name, **backend))
    ids = ids_of((1, sum(LENGTHS))).cuda()
    with torch.no_grad():
        packed = model(ids, position_ids=restarting(LENGTHS).cuda()).logits[0].float()
        alone = torch.cat([model(part[None]).logits[0].float() for part in ids[0].split(LENGTHS)])
    torch.testing.assert_close(packed, alone, atol=3e-2, rtol=3e-2)


def _flash_installed() -> bool:
    from attn_patterns.kernels import flash_available

    return flash_available()


@pytest.mark.parametrize("name", ["scca_flow", "dca", "longheads"])
def test_packed_documents_under_autocast(model, name):
    """Trainers run the model under autocast: fp32 q/k/v, kernels computing in bf16."""
    use_attention(model, pattern_of(name))
    ids = ids_of((1, sum(LENGTHS)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(ids, position_ids=restarting(LENGTHS)).logits[0].float()
        alone = torch.cat([model(part[None]).logits[0].float() for part in ids[0].split(LENGTHS)])
    torch.testing.assert_close(packed, alone, atol=3e-2, rtol=3e-2)
    use_attention(model, "full")
