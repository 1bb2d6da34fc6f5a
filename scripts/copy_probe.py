"""Does a model still copy? Teacher-forced accuracy on the passkey's digits.

Passkey retrieval needs copy (induction) heads. Greedy decoding only says whether the whole
key came out; this says where copying breaks: each prompt holds the key three times (the
needle's "The pass key is K", its "K is the pass key" a few tokens later, and the answer
after the question), and for each mention we count how often the model, fed the true prefix,
predicts digits 2-5 (the first digit of the first mention is unpredictable).

    python scripts/copy_probe.py                                     # the committed base
    python scripts/copy_probe.py --adapter runs/experiment/full-seed0/adapter --lengths 256,1024
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from sparse_ft.experiment.passkey_docs import answer_ids
from sparse_ft.evaluation.passkey_prompt import build_prompt
from sparse_ft.evaluation import loading
from sparse_ft.experiment.pretrain import ASSET_DIR

MENTIONS = ("needle", "needle repeat", "answer")


@torch.inference_mode()
def copy_accuracy(model, tokenizer, length: int, keys: int, depth: float = 0.5) -> dict[str, float]:
    hits = dict.fromkeys(MENTIONS, 0)
    for trial in range(keys):
        key = str(random.Random(trial).randint(10000, 99999))
        ids = build_prompt(tokenizer, length, depth, key).ids + answer_ids(tokenizer, key)
        predicted = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        digits = tokenizer(key, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ids) - len(digits) + 1) if ids[i : i + len(digits)] == digits]
        if len(starts) != len(MENTIONS):
            raise ValueError(f"the key {key} occurs {len(starts)} times in the prompt, expected {len(MENTIONS)}")
        for mention, start in zip(MENTIONS, starts):
            hits[mention] += sum(predicted[start + j - 1] == ids[start + j] for j in range(1, len(digits)))
    return {m: hits[m] / (keys * (len(digits) - 1)) for m in MENTIONS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ASSET_DIR))
    parser.add_argument("--adapter", default=None, help="a sparse-ft adapter (its RoPE scaling is restored)")
    parser.add_argument("--lengths", default="256", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--keys", type=int, default=6)
    args = parser.parse_args()
    model, tokenizer = loading.load(args.model, args.adapter)
    model.eval()
    result = {int(n): copy_accuracy(model, tokenizer, int(n), args.keys) for n in args.lengths.split(",")}
    print(json.dumps({"model": args.model, "adapter": args.adapter, "digits_2_to_5_correct": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
