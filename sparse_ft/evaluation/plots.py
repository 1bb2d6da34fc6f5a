"""Pictures of results: PPL against length (one line per run) and passkey heatmaps."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_format(output: Path, flag: str) -> None:
    """A picture's file name names a format matplotlib writes (by its suffix), checked before
    the evaluation it would show rather than after it."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = output.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"{flag} {output}: {'.' + suffix if suffix else 'no suffix'} names no picture format; "
                         f"allowed: {', '.join(sorted(formats))}")


def _save(fig, output: Path, writer: str) -> Path:
    """Atomically, never through a link; a PNG carries ``writer`` as its marker (``written_by``)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    kind = output.suffix.lstrip(".").lower() or "png"
    with atomic_file(output, "wb") as f:
        fig.savefig(f, format=kind, dpi=120, metadata={OUTPUT_FIELD: writer} if kind == "png" else None)
    _pyplot().close(fig)
    return output


def plot_ppl(series: list[tuple[str, list[dict]]], output: Path, dashed: Iterable[str] = (), *,
             writer: str = "sparse-ft") -> Path:
    """``series``: ``(label, results)`` per run, e.g. from :func:`report.read_ppl`; labels in
    ``dashed`` are drawn dashed (a second family, e.g. training-free methods). The y axis is
    logarithmic: a method that blows up must not flatten the ones that hold."""
    plt = _pyplot()
    many = len(series) > 6
    fig, ax = plt.subplots(figsize=(8.5 if many else 6, 4.5 if many else 4))
    colors = plt.get_cmap("tab20" if len(series) > 10 else "tab10").colors
    dashed = set(dashed)
    lengths: set[int] = set()
    for index, (label, results) in enumerate(series):
        rows = sorted(results, key=lambda r: r["length"])
        lengths.update(r["length"] for r in rows)
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=label,
                color=colors[index % len(colors)], linestyle="--" if label in dashed else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(lengths), [_tokens(n) for n in sorted(lengths)])
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.grid(alpha=0.3, which="both")
    if many:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    else:
        ax.legend()
    fig.tight_layout()
    return _save(fig, output, writer)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_passkey(cells: list[dict], output: Path, title: str = "", *, writer: str = "sparse-ft") -> Path:
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
    return _save(fig, output, writer)
