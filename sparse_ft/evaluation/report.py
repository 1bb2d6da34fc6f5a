"""Results as JSON files and markdown tables."""

from __future__ import annotations

import json
from pathlib import Path

from typing import Optional

from sparse_ft.files.outputs import atomic_file, markdown_marker


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(json.dumps(payload, indent=1))


def write_markdown(path: Path, title: str, table: str, *, command: Optional[str], writer: str) -> Path:
    """A results table as a markdown file: title, the command that made it, the table, and the
    marker naming ``writer`` (so that only sparse-ft ever replaces it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    made = f"Command: `{command}`\n\n" if command else ""
    with atomic_file(path) as f:
        f.write(f"# {title}\n\n{made}{table}\n\n{markdown_marker(writer)}\n")
    return path


def model_name(model: str) -> str:
    """A model as titles name it: a local directory by its name, an HF id whole, the built-in
    ``tiny`` as having random weights."""
    from sparse_ft.modeling.tiny import display_name

    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else display_name(model)


def read_ppl(path: Path) -> tuple[str, list[dict], Optional[str]]:
    """``(label, results, model)`` of a file written by ``eval ppl --output`` (``model`` as
    :func:`model_name` gives it; None if the file does not say)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"results file {path} does not exist")
    try:
        payload = json.loads(Path(path).read_text())
        rows = payload["results"]
        if not all("length" in r and "ppl" in r for r in rows):
            raise KeyError("length/ppl")
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path} is not a results file of `sparse-ft eval ppl --output`") from None
    model = (payload.get("config") or {}).get("model")
    return payload.get("label") or Path(path).stem, rows, model_name(model) if isinstance(model, str) else None


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
