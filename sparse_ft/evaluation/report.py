"""Results as JSON files and markdown tables."""

from __future__ import annotations

import json
from pathlib import Path

from sparse_ft.files.outputs import atomic_file


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(json.dumps(payload, indent=1))


def read_ppl(path: Path) -> tuple[str, list[dict]]:
    """``(label, results)`` of a file written by ``eval ppl --output``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"results file {path} does not exist")
    try:
        payload = json.loads(Path(path).read_text())
        rows = payload["results"]
        if not all("length" in r and "ppl" in r for r in rows):
            raise KeyError("length/ppl")
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path} is not a results file of `sparse-ft eval ppl --output`") from None
    return payload.get("label") or Path(path).stem, rows


def ppl_table(results: list[dict], label: str = "") -> str:
    lines = ["| method | length | PPL | scored tokens | seconds | tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {label} | {r['length']} | {r['ppl']:.3f} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_second']:.0f} |")
    return "\n".join(lines)


def passkey_table(cells: list[dict]) -> str:
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    lines = ["| length \\ depth | " + " | ".join(f"{d:.0%}" for d in depths) + " | mean |",
             "|---:|" + "---:|" * (len(depths) + 1)]
    for n in lengths:
        row = [acc[(n, d)] for d in depths]
        lines.append(f"| {n} | " + " | ".join(f"{a:.2f}" for a in row) + f" | {sum(row) / len(row):.2f} |")
    return "\n".join(lines)
