"""ParallelComp: chunking, the fixed-size priority queue, eviction / calibration, equality with
plain generation for one chunk, passkey end-to-end on a tiny model."""

import random

import pytest
import torch

from sparse_ft.methods import parallelcomp as pc
from sparse_ft.modeling.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("n,size", [(1, 5), (10, 5), (11, 5), (256, 200), (7, 100)])
def test_chunks_cover_context_exactly(n, size):
    spans = pc.split_chunks(n, size)
    covered = [i for s, e in spans for i in range(s, e)]
    assert covered == list(range(n))
    assert all(0 < e - s <= size for s, e in spans)
    assert len(spans) == -(-n // size)


def test_priority_queue_keeps_k_lowest_like_sorting():
    rng = random.Random(0)
    for trial in range(50):
        n, k = rng.randint(1, 40), rng.randint(1, 6)
        scores = [float(rng.randint(0, 8)) for _ in range(n)]  # many ties
        items = [(s, i, f"chunk{i}") for i, s in enumerate(scores)]
        expected = sorted(sorted(items, key=lambda t: (t[0], t[1]))[:k], key=lambda t: t[1])
        assert pc.keep_lowest(iter(items), k) == expected


def test_eviction_budget_and_calibration():
    attention = torch.tensor([[0.5, 0.01, 0.2, 0.02, 0.3, 0.6], [0.0, 0.9, 0.05, 0.04, 0.01, 0.0]])
    index, keep = pc.evict(attention, kv_budget=None, threshold=None, region=None, bias_window=2)
    assert index.tolist() == [list(range(6))] * 2 and keep.all()
    index, keep = pc.evict(attention, kv_budget=3, threshold=None, region=None, bias_window=2)  # compression: 3 highest, position order
    assert index.tolist() == [[0, 4, 5], [1, 2, 3]] and keep.all()
    _, keep = pc.evict(attention, kv_budget=None, threshold=0.4, region="sink", bias_window=2)  # first 2 tokens above 0.4 go
    assert keep.tolist() == [[False, True, True, True, True, True], [True, False, True, True, True, True]]
    _, keep = pc.evict(attention, kv_budget=None, threshold=0.4, region="recency", bias_window=2)
    assert keep.tolist() == [[True, True, True, True, True, False], [True] * 6]
    _, keep = pc.evict(attention, kv_budget=None, threshold=0.15, region="middle", bias_window=2)  # positions 2..3
    assert keep.tolist() == [[True, True, False, True, True, True], [True] * 6]
    _, keep = pc.evict(attention, kv_budget=None, threshold=0.4, region=None, bias_window=2)  # this layer calibrates nothing
    assert keep.all()
    index, keep = pc.evict(attention, kv_budget=3, threshold=0.4, region="sink", bias_window=2)  # both: calibration mask on the kept ones
    assert index.tolist() == [[0, 4, 5], [1, 2, 3]] and keep.tolist() == [[False, True, True], [False, True, True]]


def test_calibration_layers_follow_paper_depths():
    layers = pc.PAPER_CALIBRATION_LAYERS
    assert [pc.region_of(i, 32, layers) for i in (0, 7, 8, 15, 16, 23, 24, 31)] == [
        "middle", "middle", "recency", "recency", None, None, "sink", "sink"]


def test_one_chunk_equals_plain_generation(model, tok):
    g = torch.Generator().manual_seed(1)
    context = torch.randint(3, 259, (90,), generator=g).tolist()
    question = torch.randint(3, 259, (12,), generator=g).tolist()
    ids = torch.tensor([context + question])
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)[0, ids.shape[1]:].tolist()
        ours = pc.generate(model, None, context_ids=context, question_ids=question, max_new_tokens=8)
    assert ours == plain


def _kept(model, context, question, **params):
    with torch.no_grad():
        return pc.select(model, context, question, pc.ParallelCompConfig(**params))


def test_selection_keeps_lowest_self_information_chunks(model):
    g = torch.Generator().manual_seed(2)
    context = torch.randint(3, 259, (300,), generator=g).tolist()
    question = torch.randint(3, 259, (10,), generator=g).tolist()
    every = _kept(model, context, question, chunk_size=40, keep_chunks=100, batch_chunks=3)
    assert [i for _, i, _ in every] == list(range(8))  # ceil(300 / 40) chunks, all kept
    # direct check of one score: -log P(question | chunk 2) from a plain forward
    ids = torch.tensor([context[80:120] + question])
    with torch.no_grad():
        logp = model(ids).logits[0, 39:-1].log_softmax(-1)
    info = -logp.gather(-1, torch.tensor(question)[:, None]).sum().item()
    assert every[2][0] == pytest.approx(info, rel=1e-4)
    best = _kept(model, context, question, chunk_size=40, keep_chunks=3, batch_chunks=3)
    expected = sorted(sorted(every, key=lambda t: (t[0], t[1]))[:3], key=lambda t: t[1])
    assert [i for _, i, _ in best] == [i for _, i, _ in expected]


def test_eviction_flags_change_what_is_kept(model):
    g = torch.Generator().manual_seed(3)
    context = torch.randint(3, 259, (120,), generator=g).tolist()
    question = torch.randint(3, 259, (10,), generator=g).tolist()
    plain = _kept(model, context, question, chunk_size=60, keep_chunks=2)
    compressed = _kept(model, context, question, chunk_size=60, keep_chunks=2, kv_budget=20)
    calibrated = _kept(model, context, question, chunk_size=60, keep_chunks=2, calibration_threshold=0.005, bias_window=10,
                       calibration_layers={"sink": (0.0, 1.0)})
    for (_, _, (length, layers)), (_, _, (_, small)), (_, _, (_, cal)) in zip(plain, compressed, calibrated):
        for (k, _, keep), (k_small, _, keep_small), (_, _, keep_cal) in zip(layers, small, cal):
            assert k.shape[1] == length and keep.all()
            assert k_small.shape[1] == 20 and keep_small.all()
            assert not keep_cal.all() and keep_cal[:, 10:].all()  # only sink-region tokens evicted


def test_eviction_changes_the_answer_path(model):
    """Evicted tokens are really invisible in global attention: the logits move."""
    g = torch.Generator().manual_seed(4)
    context = torch.randint(3, 259, (100,), generator=g).tolist()
    question = torch.randint(3, 259, (10,), generator=g).tolist()
    with torch.no_grad():
        a = pc.generate(model, None, context_ids=context, question_ids=question, max_new_tokens=12)
        b = pc.generate(model, None, context_ids=context, question_ids=question, max_new_tokens=12, kv_budget=5)
    assert a != b


def test_validation(model):
    with pytest.raises(ValueError, match="keep_chunks=0"):
        pc.ParallelCompConfig(keep_chunks=0)
    with pytest.raises(ValueError, match="pretraining_length=256"):
        pc.generate(model, None, context_ids=[5] * 10, question_ids=[6] * 10, max_new_tokens=2, chunk_size=250)
    with pytest.raises(ValueError, match="calibration_layers"):
        pc.ParallelCompConfig(calibration_layers={"top": (0.0, 1.0)})


def test_passkey_end_to_end_on_tiny_model(model, tok):
    from sparse_ft.evaluation.tasks.passkey import Passkey
    from sparse_ft.methods import Method

    method = pc.ParallelComp(keep_chunks=1, batch_chunks=2)
    assert isinstance(method, Method) and not method.supports.ppl and "perplexity" in method.supports.no_ppl_reason
    cells = Passkey([600], [0.5], trials=1).evaluate(model, tok, method)
    assert cells[0]["prompt_tokens"] > 256 and 0.0 <= cells[0]["accuracy"] <= 1.0


def test_cli_ppl_refuses_and_says_why(tmp_path, monkeypatch, capsys):
    from sparse_ft.cli import main
    monkeypatch.chdir(tmp_path)  # the tiny model is materialised under the working directory
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    code = main(["eval", "ppl", "--model", "tiny", "--data", "text.txt", "--method", "parallelcomp", "--lengths", "64"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot report perplexity" in err and "query" in err


def test_self_information_threshold_filters_before_the_queue(model):
    """Eq. 4: only chunks with I_c <= τ enter the queue; if none does, the most relevant one
    is kept rather than answering from no context."""
    g = torch.Generator().manual_seed(2)
    context = torch.randint(3, 259, (300,), generator=g).tolist()
    question = torch.randint(3, 259, (10,), generator=g).tolist()
    every = _kept(model, context, question, chunk_size=40, keep_chunks=100)
    scores = sorted(info for info, _, _ in every)
    tau = (scores[2] + scores[3]) / 2  # exactly three chunks pass
    passed = _kept(model, context, question, chunk_size=40, keep_chunks=100, self_information_threshold=tau)
    assert [i for _, i, _ in passed] == sorted(i for info, i, _ in every if info <= tau) and len(passed) == 3
    none = _kept(model, context, question, chunk_size=40, keep_chunks=100, self_information_threshold=0.0)
    assert [info for info, _, _ in none] == [scores[0]]
    with pytest.raises(ValueError, match="self_information_threshold=-1"):
        pc.ParallelCompConfig(self_information_threshold=-1)
