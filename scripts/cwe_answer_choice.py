"""Does a base pick its cwe answers from the list? Word by word, after the reference's own answers (issue 33).

    python scripts/cwe_answer_choice.py MODEL [MODEL ...] [--length 1024] [--samples 20] [--words training] [--threads 2]

RULER's cwe scores the words a base generates, and a base that has not learned to copy from the
list scores 0 whether it is near or far. This builds the evaluation's own cwe prompts (its seeds,
its words) and feeds each one its reference answer, " 1. w1 2. w2 ...": after each " N." it
lets the base write one word, greedily. It prints, per model, the share of those words that are
one of the ten common words, some other word of the list, or no word of the list at all (a
training word: what every base so far answered), and the mean loss of the reference's words
(nats per word). The ten common words are 60 of the 64-71 entries of the list at 1,024 BPE
tokens, so a base that copies from the list at all lands mostly on them. Whole words, because
most of the evaluation's words are two to four tokens whose first ones (" s", " c") start
many words. ``--words training``: the same prompts with the words ``--retrieval-tasks
cwe_drills`` trains on instead (drawn in the evaluation's seed space, so in lists it never saw):
whether a base copies the words it was drilled on, where it does not copy the evaluation's.
"""

import argparse
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_ft.evaluation.tasks.common_words import CommonWords
from sparse_ft.evaluation.words import Words


def greedy_word(model, tokenizer, ids: list[int], most: int = 8) -> str:
    """The word the model writes next, greedily: its tokens up to the next space or line."""
    written: list[int] = []
    for _ in range(most):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + written])).logits[0, -1].argmax())
        piece = tokenizer.decode([token])
        if written and (piece[:1].isspace() or not piece.strip()):
            break
        written.append(token)
    return tokenizer.decode(written).strip()


def choices(model, tokenizer, task: CommonWords, length: int, samples: int) -> dict[str, float]:
    """Shares of answer slots where the model writes a common word, another listed word, or neither."""
    counts = {"common": 0, "listed": 0, "other": 0}
    loss = []
    for index in range(samples):
        prompt = task.fit(tokenizer, length, seed=f"cwe|{length}|{index}")
        listed = set(re.findall(r"\d+\. (\S+)", prompt.sample.context.rsplit("most often.\n", 1)[-1]))
        common = set(prompt.sample.answers)
        ids = prompt.context_ids + prompt.question_ids
        for number, word in enumerate(prompt.sample.answers, 1):
            ids = ids + tokenizer(f" {number}.", add_special_tokens=False)["input_ids"]
            written = greedy_word(model, tokenizer, ids)
            counts["common" if written in common else "listed" if written in listed else "other"] += 1
            word_ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids + word_ids])).logits[0, len(ids) - 1 : -1].float()
            loss.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(word_ids), reduction="sum")))
            ids = ids + word_ids
    total = sum(counts.values())
    return {**{kind: count / total for kind, count in counts.items()}, "loss": sum(loss) / len(loss)}


def drilled_words(tokenizer) -> tuple[str, ...]:
    """The words ``--retrieval-tasks cwe_drills`` draws its lists from, with this tokenizer."""
    from sparse_ft.experiment.retrieval_docs import ruler_tasks, training_words
    from sparse_ft.experiment.tokenizer import training_texts

    return ruler_tasks(["cwe_drills"], tokenizer, training_words(training_texts()))["cwe_drills"].words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="checkpoint directories (with their tokenizer)")
    p.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default: 1024)")
    p.add_argument("--samples", type=int, default=20, help="prompts per model (default: 20)")
    p.add_argument("--words", choices=("evaluation", "training"), default="evaluation",
                   help="the lists' words: the evaluation's, or cwe_drills' training words (default: evaluation)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | a common word | another listed word | no listed word | loss (nats per word) |")
    print("|---|---:|---:|---:|---:|")
    for path in args.models:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        task = CommonWords()
        if args.words == "training":
            task.word_lists = Words(single=drilled_words(tokenizer), keys=())
        task.setup(tokenizer, ())
        shares = choices(model, tokenizer, task, args.length, args.samples)
        print(f"| {path} | {shares['common']:.2f} | {shares['listed']:.2f} | {shares['other']:.2f} | {shares['loss']:.2f} |")


if __name__ == "__main__":
    main()
