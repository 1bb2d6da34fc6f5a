"""Results as JSON, markdown tables and pictures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


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


def plot_ppl(files: Iterable[Path], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for path in files:
        payload = json.loads(Path(path).read_text())
        rows = sorted(payload["results"], key=lambda r: r["length"])
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=payload.get("label") or Path(path).stem)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def plot_passkey(cells: list[dict], output: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    grid = np.array([[acc[(n, d)] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(lengths), 1.2 + 0.45 * len(depths)))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for y in range(len(depths)):
        for x in range(len(lengths)):
            ax.text(x, y, f"{grid[y, x]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title or "passkey retrieval")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output
