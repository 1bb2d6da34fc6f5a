"""``sparse-ft eval harness``: lm-evaluation-harness's tasks through a method, offline, on a
local task folder (YAML files and a jsonl) and the tiny base. The harness's numbers are
checked against log-likelihoods and greedy answers computed here through the same method,
and against the full model's (so a harness that ignored the method would fail)."""

import json
import math
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from sparse_ft import methods
from sparse_ft.cli import main
from sparse_ft.evaluation.prompt_tokens import token_ids
from sparse_ft.evaluation import loading, method_hflm
from sparse_ft.evaluation.tasks import harness

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "assets" / "tiny-base")
CONTEXT = 256  # the tiny base's
METHOD_PARAMS = {"full": {}, "s2": {}, "dca": {"chunk_size": 32, "local_window": 8}}
DOCS = [
    {"code": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a",
     "choices": [" * b", " / b", " + 1"], "gold": 0},
    {"code": "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        if os.path.exists(name):\n"
             "            print(name)\n    return",
     "choices": [" 0", " None", " argv"], "gold": 0},
    {"code": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
             "        self.items.append(item)\n\n    def pop(self):\n        return self.items",
     "choices": [".pop()", "[0]", ".clear()"], "gold": 0},
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{code}}}}"
target_delimiter: ""
"""
TASKS = {
    "tiny_ll": "output_type: loglikelihood\ndoc_to_target: \"{{choices[gold]}}\"\nmetric_list:\n  - metric: perplexity\n",
    "tiny_mc": "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_target: \"{{choices[gold]}}\"\ngeneration_kwargs:\n"
                "  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A local harness task folder: one jsonl, a log-likelihood, a multiple-choice and a generation task."""
    root = tmp_path_factory.mktemp("harness_tasks")
    data = root / "code.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, body in TASKS.items():
        (root / f"{name}.yaml").write_text(TASK.format(name=name, data=data) + body)
    (root / "tiny_sampled.yaml").write_text(TASK.format(name="tiny_sampled", data=data) + TASKS["tiny_gen"].replace(
        "do_sample: false", "do_sample: true"))
    (root / "tiny_missing.yaml").write_text(TASK.format(name="tiny_missing", data=root / "absent.jsonl") + TASKS["tiny_ll"])
    return root


def loaded(name: str, adapter=None):
    """The tiny base (with ``adapter``) attending through the method ``name``."""
    model, tokenizer = loading.load(BASE, adapter, device="cpu")
    method = methods.get(name, **METHOD_PARAMS[name])
    method.apply(model, CONTEXT)
    return model, tokenizer, method


@torch.inference_mode()
def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context), summed over the continuation's tokens: computed here."""
    ctx, cont = token_ids(tokenizer, context), token_ids(tokenizer, continuation)
    logits = model(input_ids=torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].double()
    return float(logits.log_softmax(-1).gather(1, torch.tensor(cont)[:, None]).sum())


@torch.inference_mode()
def greedy_answer(model, tokenizer, context: str, budget: int) -> str:
    """Greedy decoding by re-running the whole sequence per token, cut at the task's stop ("\\n")."""
    ids = token_ids(tokenizer, context)
    new = []
    for _ in range(budget):
        token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True).split("\n")[0]


def perplexity(model, tokenizer, docs=DOCS) -> float:
    """lm-eval's ``perplexity`` metric of tiny_ll: exp of minus the mean log-likelihood per document."""
    lls = [loglikelihood(model, tokenizer, d["code"], d["choices"][d["gold"]]) for d in docs]
    return math.exp(-sum(lls) / len(lls))


def accuracy(model, tokenizer) -> float:
    hits = [max(range(3), key=lambda i: loglikelihood(model, tokenizer, d["code"], d["choices"][i])) == d["gold"]
            for d in DOCS]
    return sum(hits) / len(hits)


def metric(payload: dict, task: str, name: str) -> float:
    return next(r["value"] for r in payload["results"] if (r["task"], r["metric"]) == (task, name))


def test_the_supported_version_is_the_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["harness"] == [f"lm-eval{harness.SUPPORTED}"] and harness.lm_eval_version() == "0.4.13"


@pytest.mark.parametrize("name", ["s2", "dca"])
def test_the_harness_scores_and_answers_through_the_method(name, task_dir):
    """Every request type through lm-eval's own task code: the log-likelihoods and greedy
    answers the harness got are the ones computed here through the method, and the method's
    log-likelihoods are not the full model's."""
    from lm_eval.tasks import TaskManager

    model, tokenizer, method = loaded(name)
    results = method_hflm.evaluate(model, tokenizer, method, tasks=list(TASKS), log_samples=True, max_length=CONTEXT,
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    samples = {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in TASKS}
    mine = [loglikelihood(model, tokenizer, d["code"], d["choices"][d["gold"]]) for d in DOCS]
    theirs = [s["resps"][0][0][0] for s in samples["tiny_ll"]]
    assert theirs == pytest.approx(mine, rel=1e-4, abs=1e-3)
    assert results["results"]["tiny_ll"]["perplexity,none"] == pytest.approx(math.exp(-sum(mine) / len(mine)), rel=1e-3)
    assert results["results"]["tiny_mc"]["acc,none"] == accuracy(model, tokenizer)
    answers = [s["resps"][0][0] for s in samples["tiny_gen"]]
    assert answers == [greedy_answer(model, tokenizer, d["code"], 6) for d in DOCS] and any(answers)
    full, full_tokenizer, _ = loaded("full")
    reference = [loglikelihood(full, full_tokenizer, d["code"], d["choices"][d["gold"]]) for d in DOCS]
    assert max(abs(a - b) for a, b in zip(mine, reference)) > 0.05  # the method changes what is scored


def test_eval_harness_writes_what_the_full_model_scores(task_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "harness", "--model", BASE, "--tasks", "tiny_ll,tiny_mc", "--include-path", str(task_dir), "--trust-remote-code",
                 "--batch-size", "2", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    model, tokenizer, _ = loaded("full")
    assert metric(payload, "tiny_ll", "perplexity") == pytest.approx(perplexity(model, tokenizer), rel=1e-3)
    assert metric(payload, "tiny_mc", "acc") == accuracy(model, tokenizer)
    assert payload["summary"]["lm_eval"] == "0.4.13" and payload["summary"]["max_length"] == CONTEXT
    assert {r["samples"] for r in payload["results"]} == {len(DOCS)}
    table = out.with_suffix(".md").read_text()
    assert "| full | tiny_mc | acc | none |" in table and "sparse_ft_output" in table
    assert main(["eval", "harness", "--model", BASE, "--tasks", "tiny_ll", "--include-path", str(task_dir), "--trust-remote-code",
                 "--output", str(out)]) == 2  # its own earlier output, without --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_an_adapters_rope_is_restored(task_dir, tmp_path):
    """An adapter trained with linear RoPE x2 to 512 (its LoRA is the identity): the harness
    scores the base with that RoPE, at the adapter's context (on the first two documents:
    ``--limit 2``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(BASE), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
    (adapter / "sparse_ft.json").write_text(json.dumps({
        "base_model": BASE, "base_model_given": BASE, "max_position_embeddings": 2 * CONTEXT,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}))
    out = tmp_path / "r.json"
    assert main(["eval", "harness", "--adapter", str(adapter), "--tasks", "tiny_ll", "--include-path", str(task_dir), "--trust-remote-code",
                 "--limit", "2", "--output", str(out)]) == 0
    payload = json.loads(out.read_text())
    scaled, tokenizer, _ = loaded("full", str(adapter))
    base, _, _ = loaded("full")
    assert payload["summary"]["max_length"] == 2 * CONTEXT
    assert metric(payload, "tiny_ll", "perplexity") == pytest.approx(perplexity(scaled, tokenizer, DOCS[:2]), rel=1e-3)
    assert abs(math.log(perplexity(scaled, tokenizer, DOCS[:2]) / perplexity(base, tokenizer, DOCS[:2]))) > 0.05
    assert payload["results"][0]["samples"] == 2


def test_metadata_reaches_every_task(task_dir):
    """``--metadata`` is lm-eval's: RULER reads its tokenizer and lengths there."""
    task = harness.Harness(["tiny_ll", "tiny_mc"], include_path=str(task_dir), metadata={"max_seq_lengths": [64]})
    task.prepare(None)
    assert [t.config.metadata["max_seq_lengths"] for t in task.loaded] == [[64], [64]]


ERRORS = {
    "unknown task": (["--tasks", "tiny_lll"], r"--tasks tiny_lll: no task, group or tag of that name in lm-eval 0\.4\.13 or "
                                              r"--include-path .*; close: tiny_ll"),
    "sampling task": (["--tasks", "tiny_sampled"], r"--tasks tiny_sampled samples its answers \(do_sample: true\)"),
    "missing data": (["--tasks", "tiny_missing"], r"--tasks tiny_missing: lm-eval cannot load them: .*absent\.jsonl"),
    "batch with a pattern": (["--tasks", "tiny_ll", "--method", "s2", "--batch-size", "2"],
                             r"--batch-size 2 with --method s2: lm-eval pads a batch without a mask"),
    "parallelcomp": (["--tasks", "tiny_ll", "--method", "parallelcomp"], r"--method parallelcomp cannot run harness tasks"),
    "no include path": (["--tasks", "tiny_ll", "--include-path", "NOWHERE"], r"--include-path .*NOWHERE: no such directory"),
    "bad limit": (["--tasks", "tiny_ll", "--limit", "1.5"], r"--limit 1\.5 must be a whole number >= 1 or a fraction"),
    "empty tasks": (["--tasks", ","], r"--tasks ',' names no task"),
    "metadata not an object": (["--tasks", "tiny_ll", "--metadata", "[4096]"], r"--metadata '\[4096\]' is a JSON list, not an object"),
    "metadata not JSON": (["--tasks", "tiny_ll", "--metadata", "{max: 1}"], r"--metadata '\{max: 1\}' is not JSON"),
    "metadata with a key twice": (["--tasks", "tiny_ll", "--metadata", '{"max_seq_lengths": [64], "max_seq_lengths": [128]}'],
                                   r"--metadata .*: key max_seq_lengths is given twice, at line 1, columns 2 and 27"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_harness_input_fails_in_one_line_before_the_model_loads(case, task_dir, tmp_path, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loading, "load", no_load)
    argv, message = ERRORS[case]
    argv = [str(tmp_path / "NOWHERE") if arg == "NOWHERE" else arg for arg in argv]
    assert main(["eval", "harness", "--model", BASE, "--include-path", str(task_dir), "--trust-remote-code", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sparse-ft eval: error: ") and sum("error:" in line for line in err) == 1, err
    assert re.search(message, err[-1]), err[-1]


def test_without_lm_eval_the_extra_is_named(task_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["eval", "harness", "--model", BASE, "--tasks", "tiny_ll", "--include-path", str(task_dir), "--trust-remote-code"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sparse-ft eval: error: eval harness needs lm-evaluation-harness, an optional extra: " \
                  "pip install '.[harness]' in a checkout of sparse-ft (no release exists yet)"
