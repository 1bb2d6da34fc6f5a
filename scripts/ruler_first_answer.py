"""How often a base's first value is the asked one, beside RULER's score (issue 33).

    python scripts/ruler_first_answer.py RESULTS.json [RESULTS.json ...]

RULER scores a needle task by whether the answer appears anywhere in the generated tokens. A
base trained on lookup drills goes on writing "The special magic number for KEY ... is VALUE"
for other keys after it answers, and so is credited when the asked value turns up later: on the
committed base niah_multikey_1 scores 0.30 where its first value is right 0.10 of the time, less
than a needle drawn at random (0.25). Key matching is what the first value shows. For each
``sparse-ft eval ruler`` JSON this prints, per needle task, RULER's score and the share of
samples whose output starts with the (first) answer.
"""

import argparse
import json
import re
from pathlib import Path


def first_answer(result: dict) -> float:
    """Share of ``result``'s samples whose output opens with its first expected answer."""
    hits = [bool(re.match(r"\s*" + re.escape(answers[0]), output)) for answers, output in zip(result["answers"], result["outputs"])]
    return sum(hits) / len(hits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSON files written by `sparse-ft eval ruler --output`")
    args = p.parse_args()
    print("| results | task | length | RULER score | first value right |")
    print("|---|---|---:|---:|---:|")
    for path in args.results:
        try:
            results = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"{path}: not the JSON of `sparse-ft eval ruler --output` ({type(error).__name__}: {error})")
        for result in results:
            if result["task"].startswith("niah"):
                print(f"| {path.name} | {result['task']} | {result['length']} | {result['score'] / 100:.2f} | {first_answer(result):.2f} |")


if __name__ == "__main__":
    main()
