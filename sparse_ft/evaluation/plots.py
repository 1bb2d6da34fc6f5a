"""Pictures of results: PPL against length (one line per run) and passkey heatmaps."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    _pyplot().close(fig)
    return output


def plot_ppl(series: list[tuple[str, list[dict]]], output: Path) -> Path:
    """``series``: ``(label, results)`` per run, e.g. from :func:`report.read_ppl`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    lengths: set[int] = set()
    for label, results in series:
        rows = sorted(results, key=lambda r: r["length"])
        lengths.update(r["length"] for r in rows)
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [_tokens(n) for n in sorted(lengths)])
    ax.minorticks_off()
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, output)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_passkey(cells: list[dict], output: Path, title: str = "") -> Path:
    import numpy as np

    plt = _pyplot()
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    grid = np.array([[acc[(n, d)] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(1.6 + 0.8 * len(lengths), 1.4 + 0.45 * len(depths)))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for y in range(len(depths)):
        for x in range(len(lengths)):
            ax.text(x, y, f"{grid[y, x]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title or "passkey retrieval")
    fig.tight_layout()
    return _save(fig, output)
