"""Write data/tiny/train.jsonl: the small local corpus of the `tiny` recipe. The sources of a
few standard-library modules, cut into ~4 KB documents: text every Python has, so the corpus
needs no download. The committed file was made with Python 3.11; other versions' stdlib
sources differ slightly, so regenerate only on purpose."""

import argparse
import json
from pathlib import Path

from sparse_ft.data.stdlib_text import iter_stdlib_documents

MODULES = ("heapq", "textwrap", "string", "fractions", "queue", "calendar", "difflib", "statistics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "tiny" / "train.jsonl")
    parser.add_argument("--doc-chars", type=int, default=4096)
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(args.output, "w") as out:
        for source in iter_stdlib_documents(MODULES):
            for start in range(0, len(source), args.doc_chars):
                out.write(json.dumps({"text": source[start : start + args.doc_chars]}) + "\n")
                count += 1
    print(f"wrote {count} documents to {args.output}")


if __name__ == "__main__":
    main()
