"""Write data/tiny/chat.jsonl: the chat rows of the `tiny_chat` recipe, made from the tiny
corpus (data/tiny/train.jsonl) so they need no download. Each row asks for the line that
follows a given line of a piece of standard-library source, which the answer gives: a lookup
across the context, learnable by the tiny model, with the question and context masked out of
the loss."""

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=DATA / "chat.jsonl")
    parser.add_argument("--context-chars", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for line in (DATA / "train.jsonl").read_text().splitlines():
        text = json.loads(line)["text"][: args.context_chars]
        lines = [s for s in text.splitlines()[:-1] if s.strip()]  # the last may be cut
        if len(lines) < 4:
            continue
        k = rng.randrange(len(lines) - 1)
        question = f"Here is some Python source:\n\n{text}\n\nWhich line follows this one?\n{lines[k]}"
        rows.append({"messages": [{"role": "system", "content": "Answer with the line alone."},
                                  {"role": "user", "content": question},
                                  {"role": "assistant", "content": lines[k + 1]}]})
    args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
