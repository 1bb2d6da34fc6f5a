"""Does a base match keys? Two probes of a BPE base (docs/experiment.md, "Lookup documents"):

    python scripts/probe_lookup.py /tmp/base [--prompts 10] [--documents 12]

1. lookup documents (sparse_ft.experiment.retrieval_docs.Lookup, training word lists),
   teacher-forced: the share of answers whose first token, and whose every token, the model
   predicts from the tokens before it;
2. niah_multikey_1 and _2 at the base's context, greedy, with RULER's words and with the
   training words as keys: the accuracy, and per prompt (asked needle, answered needle, needles)
   by their order in the haystack (None: an answer that is no needle's value).

A base that matches keys scores far above chance on both; one that answers with some needle
answers an unrelated index.
"""

import argparse
import random
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sparse_ft.evaluation.tasks import TASKS
from sparse_ft.experiment import retrieval_docs
from sparse_ft.experiment.tokenizer import training_texts
from sparse_ft.modeling.rope import original_context

MARKER = " mentioned in the provided text is"  # RULER's answer prefix ends so


def teacher_forced(model, tokenizer, words, essay: list[str], documents: int, context: int) -> tuple[int, float, float]:
    lookup = retrieval_docs.Lookup()
    lookup.word_lists = words
    marker = tokenizer(MARKER, add_special_tokens=False)["input_ids"]
    rng, answers, first, whole = random.Random(123), 0, 0, 0
    for index in range(documents):
        ids = retrieval_docs.retrieval_document(lookup, tokenizer, context - 1, rng, seed=f"probe:{index}",
                                                essay=essay[index * 3000:index * 3000 + 4 * context], full=True)
        with torch.no_grad():
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        for at in range(len(ids) - len(marker)):
            if ids[at:at + len(marker)] != marker:
                continue
            start = at + len(marker)
            while not tokenizer.decode(ids[start:start + 1]).strip():  # a space of its own is no part of the value
                start += 1
            end = start
            while end < len(ids) and not tokenizer.decode(ids[end:end + 1]).startswith("."):
                end += 1
            answers += 1
            first += predicted[start - 1] == ids[start]
            whole += all(predicted[k - 1] == ids[k] for k in range(start, end))
    return answers, first / answers, whole / answers


def multikey(model, tokenizer, name: str, words, essay: list[str], prompts: int, context: int) -> tuple[float, list]:
    task = TASKS.get(name)
    if words is not None:
        task.word_lists = words
    task.setup(tokenizer, essay)
    hits, where = 0, []
    for index in range(prompts):
        prompt = task.fit(tokenizer, context, seed=f"probe|{index}")
        ids = torch.tensor([prompt.context_ids + prompt.question_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        hits += prompt.answers[0] in answer
        values = [v for _, v in re.findall(r"for (\S+) is: (\d+)\.", prompt.sample.context)]
        got = re.search(r"\d{7}", answer)
        where.append((values.index(prompt.answers[0]), values.index(got.group(0)) if got and got.group(0) in values else None,
                      len(values)))
    return hits / prompts, where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a BPE base (sparse-ft pretrain --tokenizer bpe)")
    parser.add_argument("--prompts", type=int, default=10, help="niah_multikey prompts per task and word list")
    parser.add_argument("--documents", type=int, default=12, help="lookup documents, teacher-forced")
    args = parser.parse_args()
    for flag, value in (("--prompts", args.prompts), ("--documents", args.documents)):
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    context = original_context(AutoConfig.from_pretrained(args.model))
    texts = list(training_texts())
    words = retrieval_docs.training_words(texts)
    essay = [word for text in texts[:300] for word in text.split()]
    answers, first, whole = teacher_forced(model, tokenizer, words, essay, args.documents, context)
    print(f"lookup documents, teacher-forced: {answers} answers, first token {first:.2f}, whole value {whole:.2f}")
    for name in ("niah_multikey_1", "niah_multikey_2"):
        for label, keys in (("RULER's words", None), ("training words", words)):
            accuracy, where = multikey(model, tokenizer, name, keys, essay[:20000], args.prompts, context)
            print(f"{name} at {context}, {label}: {accuracy:.2f}; (asked, answered, needles): {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
