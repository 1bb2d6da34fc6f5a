"""Does a base copy vt's variables? Letter by letter, on the reference answer (issue 33).

    python scripts/vt_answer_letters.py MODEL [MODEL ...] [--length 1024] [--samples 10] [--threads 2]

RULER's vt credits each variable of the chain found in what a base writes; a base that writes
variables of the right form but not the prompt's scores 0, and so does one that would copy a
variable once its first letter were right. This builds the evaluation's own vt prompts (its
seeds) and feeds each one its reference answer, the chain's variables in order; the BPE
tokenizer writes a variable mostly as its letters, one token each (" Z", "Y", "B", "J", "W";
about one variable in two merges two letters or splits off the space). It prints, per model,
the mean loss (nats) of the first token of the first variable (found only by matching the
asked value), of that variable's later tokens (a copy, once the first is given), of the later
variables' first tokens and of their later tokens; and the probability the base gives the
chain's first tokens at the answer's first token. A uniform letter costs ln 26 = 3.26 nats; a
base that copies a variable once started pays far less on its later tokens.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_ft.evaluation.tasks.variable_tracking import VariableTracking

GROUPS = ("first token, first variable", "later tokens, first variable", "first tokens, later variables",
          "later tokens, later variables")


def letter_losses(model, tokenizer, task: VariableTracking, length: int, samples: int) -> dict[str, float]:
    """Mean loss per group of the reference answer's tokens, and the mass on the chain's first tokens."""
    losses: dict[str, list[float]] = {group: [] for group in GROUPS}
    mass = []
    for index in range(samples):
        prompt = task.fit(tokenizer, length, seed=f"vt|{length}|{index}")
        ids = prompt.context_ids + prompt.question_ids
        variables = [tokenizer(" " + v, add_special_tokens=False)["input_ids"] for v in prompt.sample.answers]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids + sum(variables, [])])).logits[0].float(), dim=-1)
        mass.append(logp[len(ids) - 1, sorted({v[0] for v in variables})].exp().sum().item())
        at = len(ids) - 1  # the position whose logits predict the next answer token
        for k, tokens in enumerate(variables):
            for j, token in enumerate(tokens):
                losses[GROUPS[2 * (k > 0) + (j > 0)]].append(-logp[at, token].item())
                at += 1
    return {**{group: sum(v) / len(v) for group, v in losses.items()}, "first-token mass": sum(mass) / len(mass)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="checkpoint directories (with their tokenizer)")
    p.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default: 1024)")
    p.add_argument("--samples", type=int, default=10, help="prompts per model (default: 10)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | " + " | ".join(GROUPS) + " | P(a variable's first token) at the answer's start |")
    print("|---|" + "---:|" * (len(GROUPS) + 1))
    for path in args.models:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        task = VariableTracking()
        task.setup(tokenizer, ())
        out = letter_losses(model, tokenizer, task, args.length, args.samples)
        print(f"| {path} | " + " | ".join(f"{out[g]:.2f}" for g in GROUPS) + f" | {out['first-token mass']:.3f} |")


if __name__ == "__main__":
    main()
