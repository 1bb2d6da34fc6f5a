"""The task registry and RULER's synthetic tasks: names taken once, every task an ``eval``
command, prompts deterministic from a seed and as long as asked in the model's tokens,
RULER's metric, the effective context length, a run end to end through ``full`` and ``dca``,
and bad inputs refused in one line before the weights load."""

import json
import random
import re

import pytest

from sparse_ft.cli import main
from sparse_ft.evaluation.prompt_tokens import token_ids
from sparse_ft.evaluation import tasks
from sparse_ft.evaluation.effective_length import means_by_length, summarise
from sparse_ft.evaluation.tasks.generation import (GenerationTask, Sample, postprocess, split_template, string_match_all,
                                                   string_match_part)
from sparse_ft.modeling.tiny import tiny_tokenizer

RULER_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
               "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_the_registry_refuses_a_taken_name_and_lists_every_task_as_a_command():
    class Shadow(tasks.Task):
        name = "passkey"

    with pytest.raises(ValueError, match=r"task name 'passkey' is already taken by "
                                         r"sparse_ft\.evaluation\.tasks\.passkey\.Passkey; .*Shadow"):
        tasks.register(Shadow)
    assert tasks.names() == ["ppl", "passkey", "ruler", *RULER_TASKS, "harness"]
    from sparse_ft.cli import build_parser

    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    assert list(eval_parser._subparsers._group_actions[0].choices) == [*tasks.names(), "plot"]


TEMPLATE = "Remember the word.\n{context}\nWhich word was repeated? The word is"


class Echo(GenerationTask):
    """docs/architecture.md's walkthrough: a new task in a few lines."""

    name = "toy_echo"
    summary = "say the repeated word"
    unit = "words"

    def __init__(self, *, tokens_to_generate: int = 4):
        self.tokens_to_generate = tokens_to_generate

    def compose(self, rng: random.Random, size: int, *, length: int) -> Sample:
        word = rng.choice(["apple", "river", "stone"])
        context, question = split_template(TEMPLATE, " ".join([word] * size))
        return Sample(context, question, (word,))


def test_a_new_task_is_one_class(tmp_path, capsys):
    tasks.register(Echo)
    try:
        out = tmp_path / "echo.json"
        assert main(["eval", "toy_echo", "--model", "tiny", "--lengths", "128", "--samples", "2", "--output", str(out),
                     "--task-arg", "toy_echo.tokens_to_generate=6"]) == 0
        payload = json.loads(out.read_text())
        assert payload["sparse_ft_output"] == "sparse-ft eval toy_echo" and payload["summary"]["tasks"] == ["toy_echo"]
        assert [(r["samples"], r["tokens_to_generate"]) for r in payload["results"]] == [(2, 6)]
        assert "| toy_echo |" in out.with_suffix(".md").read_text()
        assert main(["eval", "ruler", "--model", "tiny", "--lengths", "128", "--samples", "1", "--tasks", "toy_echo"]) == 0
    finally:
        tasks.TASKS.remove("toy_echo")


@pytest.mark.parametrize("name", RULER_TASKS)
def test_prompts_are_deterministic_and_fill_the_length(name, tokenizer):
    length = 2048

    def prompts(seed):
        suite = tasks.get("ruler", lengths=[length], tasks=[name], samples=2, seed=seed)
        suite.prepare(tokenizer)
        return suite.tasks[0], suite.prompts[(name, length)]

    task, first = prompts(0)
    _, again = prompts(0)
    _, other = prompts(1)
    assert [p.context_ids + p.question_ids for p in first] == [p.context_ids + p.question_ids for p in again]
    assert [p.sample for p in first] != [p.sample for p in other]
    assert first[0].sample != first[1].sample  # samples differ from each other too
    for index, prompt in enumerate(first):
        # as long as it may be (prompt + generation budget within the length), and one unit
        # more of haystack would not fit
        assert prompt.tokens + task.tokens_to_generate <= length
        bigger = task.compose(random.Random(f"0:{name}:{index}"), prompt.size + 1, length=length)
        assert len(token_ids(tokenizer, bigger.context)) + len(token_ids(tokenizer, bigger.question)) + \
            task.tokens_to_generate > length
        assert tokenizer.decode(prompt.context_ids) == prompt.sample.context
        assert all(answer in prompt.sample.context for answer in prompt.sample.answers)  # there to be found


def test_templates_follow_ruler(tokenizer):
    single = tasks.get("niah_single_1").fit(tokenizer, 1024, seed="x")
    multi = tasks.get("niah_multivalue")
    multi.setup(tokenizer, "Some words here. And more words there.".split())
    many = multi.fit(tokenizer, 1024, seed="x")
    assert single.sample.context.startswith("A special magic number is hidden within the following text. Make sure to "
                                            "memorize it. I will quiz you about the number afterwards.\n")
    assert single.sample.question.startswith("\nWhat is the special magic number for ")
    assert single.sample.question.endswith(" mentioned in the provided text is")
    assert "One of the special magic numbers for " in single.sample.context and len(single.sample.answers[0]) == 7
    assert many.sample.question.startswith("\nWhat are all the special magic numbers for ") and len(many.sample.answers) == 4
    vt = tasks.get("vt", fewshot=False).fit(tokenizer, 1024, seed="x")
    assert re.fullmatch(r"\nQuestion: Find all variables that are assigned the value (\d{5}) in the text above\. Answer: "
                        r"According to the chain\(s\) of variable assignment in the text above, 5 variables are assigned "
                        r"the value \1, they are: ", vt.sample.question)
    assert vt.sample.context.startswith("Memorize and track the chain(s) of variable assignment hidden in the following "
                                        "text.\n\n") and len(vt.sample.answers) == 5
    fwe = tasks.get("fwe").fit(tokenizer, 1024, seed="x")
    assert fwe.sample.context.count(" ... ") > max(fwe.sample.context.count(w) for w in fwe.sample.answers)


def test_no_word_to_find_is_in_a_template():
    """string_match_all counts substrings: an answer that echoes the prompt must not score."""
    from sparse_ft.evaluation.passkey_prompt import FILLER
    from sparse_ft.evaluation.words import single_words
    from sparse_ft.evaluation.tasks import common_words, frequent_words, niah, variable_tracking

    prose = " ".join([niah.TEMPLATE, niah.NEEDLE, variable_tracking.TEMPLATE, common_words.TEMPLATE,
                      frequent_words.TEMPLATE, FILLER]).lower()
    assert [w for w in single_words() if any(w in t for t in re.findall(r"[a-z]+", prose))] == []


def test_scoring_is_rulers():
    assert postprocess("  \x00The numbers are 1234567\tand 7654321.\n") == "The numbers are 1234567\nand 7654321."
    assert string_match_all("The answers: 1234567 and 7654321", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_all("HAPPY-CAT and sad-dog", ["happy-cat", "sad-dog"]) == 1.0  # case-insensitive substrings
    assert string_match_part("It is paris.", ["London", "Paris"]) == 1.0 and string_match_part("Rome", ["Paris"]) == 0.0
    task = tasks.get("niah_multivalue")
    assert task.score("\n1, 2\x1f3", ["1", "3", "9"]) == pytest.approx(2 / 3)


def test_a_row_scores_the_mean_over_samples_in_percent(tokenizer):
    """RULER's aggregate: the per-sample string_match_all, averaged, x 100."""
    suite = tasks.get("ruler", lengths=[1024], tasks=["niah_multivalue"], samples=2, seed=3)
    suite.prepare(tokenizer)
    prompts = suite.prompts[("niah_multivalue", 1024)]

    class Answers:
        name = "fake"
        outputs = iter([" " + ", ".join(prompts[0].sample.answers[:3]), " none"])

        def generate(self, model, tok, *, context_ids, question_ids, max_new_tokens):
            return token_ids(tok, next(self.outputs))

    row = suite._run(None, tokenizer, Answers(), task=suite.tasks[0], length=1024, prompts=prompts)
    assert row["scores"] == [0.75, 0.0] and row["score"] == pytest.approx(37.5)


def test_effective_length_on_a_score_table():
    rows = [{"task": t, "length": n, "score": s} for n, scores in
            {512: (96, 94), 1024: (90, 86), 2048: (84, 76), 4096: (70, 50)}.items() for t, s in zip("ab", scores)]
    means = means_by_length(rows)
    assert means == {512: 95, 1024: 88, 2048: 80, 4096: 60}
    found = summarise(means, fraction=0.9, base_mean=80.0)  # RULER's 85.6; 0.9 x 80 = 72
    assert (found["ruler"]["threshold"], found["ruler"]["length"], found["ruler"]["longest_evaluated"]) == (85.6, 1024, False)
    assert (found["relative"]["threshold"], found["relative"]["length"]) == (pytest.approx(72.0), 2048)
    assert summarise(means, fraction=0.5, base_mean=100.0)["relative"]["longest_evaluated"]  # 60 >= 50 at 4096
    assert summarise(means, threshold=99.0, fraction=1.0, base_mean=96.0)["ruler"]["length"] is None
    assert summarise({n: 85.6 for n in means}, fraction=1.0, base_mean=None)["ruler"]["length"] == 4096  # a tie clears
    none = summarise(means, fraction=0.9, base_mean=None, note="why")["relative"]
    assert (none["threshold"], none["length"], none["note"]) == (None, None, "why")
    assert summarise(means, fraction=0.9, base_mean=0.0)["relative"]["note"] == "the base scores 0 at its pretraining length"


@pytest.fixture(scope="module")
def base_1024(tmp_path_factory):
    """A tiny model pretrained (so to speak) at 1024: the base is measurable at its context."""
    from sparse_ft.modeling.model_io import materialize_tiny

    return str(materialize_tiny(tmp_path_factory.mktemp("base") / "tiny-1024", 0, max_position_embeddings=1024))


def test_ruler_end_to_end_through_full_and_dca(base_1024, tmp_path, capsys):
    args = ["--model", base_1024, "--lengths", "1024,2048", "--tasks", "niah_single_1,fwe", "--samples", "1",
            "--task-arg", "niah_single_1.tokens_to_generate=8", "--task-arg", "fwe.tokens_to_generate=8"]
    full, dca = tmp_path / "full.json", tmp_path / "dca.json"
    assert main(["eval", "ruler", *args, "--output", str(full), "--heatmap", str(tmp_path / "full.png")]) == 0
    payload = json.loads(full.read_text())
    assert [(r["task"], r["length"]) for r in payload["results"]] == [("niah_single_1", 1024), ("fwe", 1024),
                                                                      ("niah_single_1", 2048), ("fwe", 2048)]
    assert all(n - 8 - 91 < sum(r["prompt_tokens"]) <= n - 8 for r in payload["results"] for n in [r["length"]])
    base = payload["summary"]["base"]
    assert base["length"] == 1024 and base["source"].endswith("its rows at the pretraining length")
    relative = payload["summary"]["effective_length"]["relative"]
    assert relative["fraction"] == 0.9 and (relative["threshold"] is None) == (base["mean"] == 0)
    markdown = full.with_suffix(".md").read_text()
    assert "| niah_single_1 |" in markdown and "Effective length, mean >= 85.6" in markdown
    assert markdown.rstrip().endswith("<!-- sparse_ft_output: sparse-ft eval ruler -->")
    assert (tmp_path / "full.png").stat().st_size > 1000
    # dca: the base is measured first with full attention at 1024, and equals the full run's
    assert main(["eval", "ruler", *args, "--method", "dca", "--output", str(dca)]) == 0
    measured = json.loads(dca.read_text())["summary"]["base"]
    assert measured["source"].startswith("this run: full attention") and measured["scores"] == base["scores"]
    assert [r["outputs"] for r in measured["rows"]] == [r["outputs"] for r in payload["results"][:2]]
    # a reference file gives the base instead
    again = tmp_path / "again.json"
    assert main(["eval", "fwe", *args[:4], "--samples", "1", "--task-arg", "fwe.tokens_to_generate=8", "--method", "dca",
                 "--reference", str(full), "--output", str(again)]) == 0
    summary = json.loads(again.read_text())["summary"]
    assert summary["base"]["source"] == f"--reference {full}" and summary["base"]["scores"] == {"fwe": base["scores"]["fwe"]}


def test_bad_inputs_are_one_line_before_the_weights_load(base_1024, tmp_path, capsys, monkeypatch):
    import transformers

    def weights(*args, **kwargs):
        raise AssertionError("the weights load")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", weights)
    (tmp_path / "theirs.md").write_text("mine")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1"))
    cases = [
        (["ruler", "--tasks", "niah_single_1,bogus"], "--tasks 'bogus' is unknown; allowed: niah_single_1, "),
        (["ruler", "--tasks", "vt,vt"], "must name each task once"),
        (["niah_single_1", "--lengths", "300"], "--lengths 300 is shorter than the shortest niah_single_1 prompt: "),
        (["niah_single_2", "--lengths", "2048", "--haystack", str(tmp_path / "none.txt")], "none.txt does not exist"),
        (["niah_single_2", "--lengths", "2048", "--haystack", str(tmp_path / "latin1.txt")], "is not UTF-8 text"),
        (["vt", "--lengths", "2048", "--haystack", str(tmp_path / "latin1.txt")], "read by the essay-haystack tasks only"),
        (["vt", "--task-arg", "vt.hops=2"], "--task-arg: vt: parameter(s) hops unknown; allowed: num_chains, num_hops"),
        (["vt", "--task-arg", "fwe.alpha=2"], "with TASK among the tasks run (vt)"),
        (["vt", "--task-arg", "vt.num_hops=0"], "vt: num_hops=0 must be an integer >= 1"),
        (["fwe", "--samples", "0"], "--samples 0 must be an integer >= 1"),
        (["fwe", "--relative-threshold", "0"], "--relative-threshold 0.0 must be > 0"),
        (["fwe", "--reference", str(tmp_path / "none.json")], "none.json does not exist"),
        (["fwe", "--lengths", "2048", "--output", str(tmp_path / "r.md")], "names the results JSON"),
        (["fwe", "--lengths", "2048", "--output", str(tmp_path / "theirs.json")], "theirs.md exists and was not written by"),
    ]
    for argv, message in cases:
        assert main(["eval", argv[0], "--model", "tiny", *argv[1:]]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "weights load" not in err, (argv, err)
    assert (tmp_path / "theirs.md").read_text() == "mine" and not (tmp_path / "theirs.json").exists()


def test_a_tokenizer_that_cannot_encode_a_prompt_and_a_base_of_unknown_context_are_refused():
    """A prompt holding the tokenizer's unknown token (a needle lost) is refused naming the task
    and the length; a config without a pretraining context is refused before the weights load."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sparse_ft.evaluation.names import BadParameter
    from sparse_ft.evaluation.tasks import TASKS
    from sparse_ft.modeling.rope import original_context

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "The": 1, "grass": 2, "is": 3, "green.": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    task = TASKS.get("niah_single_1")
    task.setup(tokenizer, ())
    with pytest.raises(BadParameter, match=r"^niah_single_1 at --lengths 400: this tokenizer cannot encode the prompt's text "
                                           r"\(\d+ unknown tokens, the first in '.*'\); use a tokenizer that encodes every"):
        task.fit(tokenizer, 400, seed="0")
    with pytest.raises(ValueError, match=r"^the model's config \(SimpleNamespace\) has no max_position_embeddings: its "
                                         r"pretraining context is unknown"):
        TASKS.factory("ruler")([1024], ["niah_single_1"]).check_model(SimpleNamespace())
    assert original_context(SimpleNamespace(max_position_embeddings=256)) == 256


@pytest.mark.parametrize("chains,digest", [(1, "c7c45c5b0908d1e293d8657efb5e4159cc4f637c3e5d6c129a0bd6245a4d43de"),
                                           (2, "7c0c7c4f520496f57144d66ea5c7666cf7b288411efbf5b54749a0fc212f4bfb")])
def test_variable_tracking_prompts_stay_byte_for_byte_what_they_were(chains, digest):
    """vt's prompt for a seed is pinned: the digests are of the prompts the code wrote before its
    chains and their hiding became reusable steps (shared with the training-only vt drills), so
    that change, or any later one, cannot move the evaluation's prompts and the scores measured
    on them."""
    import hashlib

    from sparse_ft.evaluation.tasks.variable_tracking import VariableTracking

    sample = VariableTracking(fewshot=False, num_chains=chains).compose(random.Random(7), 6, length=1024)
    text = sample.context + "|" + sample.question + "|" + " ".join(sample.answers)
    assert hashlib.sha256(text.encode()).hexdigest() == digest


@pytest.mark.parametrize("size,length,digest", [
    (40, 1024, "adf7b898dab8141dc3ba809646ce7a7599196ec6f8dca41fbe77d8b9f604242b"),
    (200, 4096, "ec2c7f53c052a33afda5bf3fb3e927616db41ea917befad9fa50fe39e2fe35fc"),
    (900, 32768, "4cee11385697a160c8a70c4d8e89e776dd2b27274be977c96a87ab51807ee2d0")])  # 900: the keys extend the words
def test_common_words_prompts_stay_byte_for_byte_what_they_were(size, length, digest):
    """cwe's prompt for a seed is pinned as vt's is: the digests are of the prompts written
    before its word pool and listing became steps that the training-only cwe drills reuse."""
    import hashlib

    from sparse_ft.evaluation.tasks.common_words import CommonWords

    sample = CommonWords().compose(random.Random(7), size, length=length)
    text = sample.context + "|" + sample.question + "|" + " ".join(sample.answers)
    assert hashlib.sha256(text.encode()).hexdigest() == digest
