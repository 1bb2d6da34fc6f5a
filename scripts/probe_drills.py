"""Can a base learn to match keys at all? Train it on drills alone and watch (issue 33).

    python scripts/probe_drills.py BASE OUTPUT [--steps 800] [--until 0.95 --max-steps 1600] [--needles 8] [--length 512]
                                               [--keys rare]
                                               [--until-task niah_multikey_1 --until-samples 30] [--seed 1] [--threads 1]

niah_multikey_1 asks for one of four needles' values; a base that has copy heads but no key
matching answers with a needle at random (0.2-0.3). This probe continues BASE's training on
documents of drills only: ``--needles`` needles in RULER's form (training-word keys, 7-digit
values; no haystack), then RULER's answer sentence for keys drawn at random, each followed by
its value, to the document's end (the drills of ``retrieval_docs.Lookup``, at full density).
Every 50 steps it prints the share of drills on 16 held-out documents whose first digit (the
choice of needle: the digits after it are copying) and whole value the model predicts,
teacher-forced. With ``--until``, training goes on past ``--steps`` in 50-step spans until the
first digit reaches that share (or ``--max-steps``): seeds form the matching at different times
(seed 3 by step 200, seed 1 not by 400). With ``--until-task`` the share that decides is
that RULER task's score at the base's context C on ``--until-samples`` held-out prompts
(:mod:`sparse_ft.experiment.heldout`: training words and text, a seed space of its own; the
drills pass at 512 tokens long before a base picks one needle of four at C: seed 2's drills read
0.977 where RULER's niah_multikey_1 read 0.72). The lr is constant, so a longer run is the same run
continued. It writes the trained checkpoint to OUTPUT and the curve to OUTPUT/probe.json;
``sparse-ft eval ruler --model OUTPUT`` then says whether the matching carries over to RULER.
Full-parameter AdamW at a constant lr, loss on every token. Its checkpoint is also the first half of
the drilled base: `sparse-ft pretrain --init-from OUTPUT --lookup-fraction 0.9 ...` (docs/experiment.md).
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks
from sparse_ft.evaluation.tasks.niah import NEEDLE
from sparse_ft.experiment.heldout import HeldOut
from sparse_ft.experiment.retrieval_docs import DRILL, KEY_RANKS, training_words
from sparse_ft.experiment.tokenizer import training_texts
from sparse_ft.files.outputs import atomic_directory
from sparse_ft.modeling.rope import original_context


def document(tokenizer, keys: list[str], rng: random.Random, n: int, length: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``n`` needles and drills to ``length``, and each drill's (first digit, digits)."""
    chosen = rng.sample(keys, n)
    values = [str(rng.randrange(10**6, 10**7)) for _ in chosen]
    ids: list[int] = []

    def add(text: str) -> None:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])

    for key, value in zip(chosen, values):
        add(" " + NEEDLE.format(type_needle_v="numbers", key=key, value=value))
    answers = []
    while len(ids) < length:
        i = rng.randrange(n)
        add(DRILL.format(type_needle_v="number", query=chosen[i]) + " ")
        answers.append((len(ids), len(values[i])))
        add(f"{values[i]}.")
    return ids[:length], [(start, digits) for start, digits in answers if start + digits <= length]


def accuracy(model, tokenizer, keys: list[str], n: int, length: int) -> tuple[float, float]:
    """Teacher-forced share of drills whose first digit, and whose every digit, is predicted."""
    rng, first, whole, total = random.Random(999), 0, 0, 0
    model.eval()
    with torch.no_grad():
        for _ in range(16):
            ids, answers = document(tokenizer, keys, rng, n, length)
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            for start, digits in answers:
                total += 1
                first += predicted[start - 1] == ids[start]
                whole += all(predicted[k - 1] == ids[k] for k in range(start, start + digits))
    model.train()
    return round(first / total, 3), round(whole / total, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base")
    p.add_argument("output", type=Path)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--until", type=float, default=None,
                   help="after --steps, go on until the first-digit share (or --until-task's score) reaches this "
                        "(default: stop at --steps)")
    p.add_argument("--max-steps", type=int, default=None, help="with --until, stop here whatever the share (default 4 x --steps)")
    p.add_argument("--until-task", default=None,
                   help="with --until, the share is this RULER task's held-out score at the base's context "
                        "(sparse_ft.experiment.heldout), not the drills' first digit")
    p.add_argument("--until-samples", type=int, default=30, help="held-out prompts of --until-task (default 30)")
    p.add_argument("--needles", type=int, default=8, help="needles per document (default 8)")
    p.add_argument("--keys", choices=tuple(KEY_RANKS), default="frequent",
                   help="the needles' keys, as `sparse-ft pretrain --keys`: pairs of frequent words, or of rare ones "
                        "that split into as many BPE pieces as the evaluation's keys (default frequent)")
    p.add_argument("--length", type=int, default=512, help="tokens per document (default 512)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1, help="the documents' random stream (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    if args.max_steps is not None and args.until is None:
        p.error(f"--max-steps {args.max_steps}: only with --until (without it training stops at --steps {args.steps})")
    if args.until is not None and not 0 < args.until <= 1:
        p.error(f"--until {args.until}: must be a share in (0, 1]")
    if args.until_task is not None and args.until is None:
        p.error(f"--until-task {args.until_task}: only with --until (the share it reads decides when to stop)")
    if args.until_task is not None and args.until_task not in (tasks := registered_ruler_tasks()):
        p.error(f"--until-task {args.until_task}: not a RULER task; one of {', '.join(tasks)}")
    if args.until_samples < 1:
        p.error(f"--until-samples {args.until_samples}: must be >= 1")
    max_steps = args.steps if args.until is None else (args.max_steps or 4 * args.steps)
    if max_steps < args.steps:
        p.error(f"--max-steps {max_steps}: must be at least --steps {args.steps}")
    if args.output.exists() and any(args.output.iterdir()):
        raise SystemExit(f"OUTPUT {args.output} is not empty; name a new directory")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    texts = list(training_texts())
    keys = list(training_words(texts, keys=args.keys).keys)
    held = None
    if args.until_task is not None:
        context = original_context(model.config)
        held = HeldOut(tokenizer, [args.until_task], length=context, samples=args.until_samples, texts=texts)

    def measure() -> dict:
        """The curve's point: the drills' shares, and the held-out task's score when one decides."""
        first, whole = accuracy(model, tokenizer, keys, args.needles, args.length)
        point = {"first_digit": first, "whole_value": whole}
        if held is not None:
            point[args.until_task] = held.scores(model)[args.until_task]
        return point

    def share(point: dict) -> float:
        return point[args.until_task] if held is not None else point["first_digit"]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, began = random.Random(args.seed), time.perf_counter()
    point = measure()
    curve = [{"step": 0, **point}]
    print(f"step 0 {point}", flush=True)
    step = 0
    while step < args.steps or (step < max_steps and share(point) < args.until):
        step += 1
        batch = torch.tensor([document(tokenizer, keys, rng, args.needles, args.length)[0] for _ in range(args.batch_size)])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step in (args.steps, max_steps):
            point = measure()
            seconds = time.perf_counter() - began
            curve.append({"step": step, "loss": loss.item(), **point, "seconds": seconds})
            print(f"step {step} loss {loss.item():.3f} {point} {seconds:.0f} s", flush=True)
    with atomic_directory(args.output, "scripts/probe_drills.py", False, "OUTPUT") as tmp:  # whole, or not at all
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "probe.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                    "steps": step, "curve": curve}, indent=1))


if __name__ == "__main__":
    main()
