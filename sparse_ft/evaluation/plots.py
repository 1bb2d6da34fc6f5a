"""Pictures of results: PPL against length (one line per run), passkey and RULER heatmaps.

A picture must not mislead a reader who only looks at it: its title names the model and the
runs, the log axis of PPL has labelled ticks at both ends of the data, and curves that lie
on top of each other differ in marker and line style, not in colour alone. Heatmaps use a
perceptually uniform map that reads the same to colour-blind readers and in grey, with every
cell's value written in.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file

MARKERS = "osD^vP*Xh<>p"
# Dark to bright, monotonic in lightness: no red-green contrast carries the scores (RdYlGn did).
HEATMAP_CMAP = "viridis"
LINESTYLES = ((0, ()), (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (3, 1, 1, 1, 1, 1)))  # solid, dashed, dotted, ...
# Nice numbers per decade, finer when the data spans few decades, for the labelled ticks of a log axis.
LOG_STEPS = ((0.3, (1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2, 2.2, 2.4, 2.6, 2.8, 3, 3.2, 3.4, 3.6, 3.8, 4, 4.5, 5, 5.5, 6, 7,
                    8, 9)),
             (1.0, (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)), (2.0, (1, 1.5, 2, 3, 5, 7)), (3.0, (1, 2, 5)), (math.inf, (1,)))


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


def log_ticks(low: float, high: float) -> list[float]:
    """Labelled ticks of a log axis from a nice number at or below ``low`` to one at or above
    ``high`` (both ends of the data are labelled), as fine as the span allows."""
    span = math.log10(high / low)
    steps = next(steps for limit, steps in LOG_STEPS if span <= limit)
    candidates = sorted(step * 10.0 ** e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
                        for step in steps)
    bottom = max(c for c in candidates if c <= low * (1 + 1e-9))
    top = min(c for c in candidates if c >= high * (1 - 1e-9))
    return [c for c in candidates if bottom <= c <= top]


def _tick_label(value: float) -> str:
    return f"{value:g}"


def plot_ppl(series: list[tuple[str, list[dict]]], output: Path, dashed: Iterable[str] = (), *, title: str = "",
             writer: str = "sparse-ft") -> Path:
    """``series``: ``(label, results)`` per run, e.g. from :func:`report.read_ppl`; labels in
    ``dashed`` form a second family (e.g. training-free methods), drawn in broken lines. The y
    axis is logarithmic, so that a method that blows up does not flatten the ones that hold;
    ``title`` should name the model."""
    plt = _pyplot()
    many = len(series) > 6
    fig, ax = plt.subplots(figsize=(9 if many else 6.5, 5 if many else 4.2))
    colors = plt.get_cmap("tab20" if len(series) > 10 else "tab10").colors
    dashed = set(dashed)
    lengths: set[int] = set()
    values: list[float] = []
    families = {False: 0, True: 0}  # curves drawn so far per family: the next marker and line style
    for index, (label, results) in enumerate(series):
        rows = sorted(results, key=lambda r: r["length"])
        lengths.update(r["length"] for r in rows)
        values += [r["ppl"] for r in rows]
        second = label in dashed
        order = families[second]
        families[second] += 1
        style = LINESTYLES[1 + order % (len(LINESTYLES) - 1)] if second else LINESTYLES[0]
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], label=label, color=colors[index % len(colors)],
                linestyle=style, marker=MARKERS[order % len(MARKERS)], markersize=6, linewidth=1.6,
                markerfacecolor="none" if second else None, markeredgewidth=1.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(lengths), [_tokens(n) for n in sorted(lengths)])
    if values:
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

        ticks = log_ticks(min(values), max(values))
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.set_yticklabels([_tick_label(t) for t in ticks])
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(ticks[0] / 1.03, ticks[-1] * 1.03)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title or "perplexity vs length", fontsize="medium")
    ax.grid(alpha=0.3, which="both")
    if many:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    else:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, output, writer)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _heatmap(grid: Sequence[Sequence[float]], output: Path, *, columns: list[str], rows: list[str], xlabel: str,
             ylabel: str, scale: float, colorbar: str, digits: int, title: str, writer: str, summary_row: bool = False) -> Path:
    """A table of scores in [0, ``scale``] in :data:`HEATMAP_CMAP`, each cell written in, in
    black on bright cells and white on dark ones; with ``summary_row`` the last row (a mean) is
    set apart by a line."""
    import numpy as np

    plt = _pyplot()
    values = np.array(grid, dtype=float)
    width = max(5.6, 2.2 + 0.8 * len(columns) + 0.06 * max(map(len, rows)))
    fig, ax = plt.subplots(figsize=(width, 1.8 + 0.45 * len(rows)))
    image = ax.imshow(values, vmin=0, vmax=scale, cmap=HEATMAP_CMAP, aspect="auto", origin="upper")
    if summary_row:
        for color, width in (("white", 4), ("black", 1.5)):  # seen on the darkest and the brightest cells
            ax.axhline(len(rows) - 1.5, color=color, linewidth=width)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for y in range(len(rows)):
        for x in range(len(columns)):
            red, green, blue, _ = image.cmap(image.norm(values[y, x]))
            ink = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"  # luma
            ax.text(x, y, f"{values[y, x]:.{digits}f}", ha="center", va="center", fontsize=8, color=ink)
    fig.colorbar(image, ax=ax, label=colorbar)
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    return _save(fig, output, writer)


def plot_passkey(cells: list[dict], output: Path, title: str = "", *, writer: str = "sparse-ft") -> Path:
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    return _heatmap([[acc[(n, d)] for n in lengths] for d in depths], output, columns=[_tokens(n) for n in lengths],
                    rows=[f"{d:.0%}" for d in depths], xlabel="prompt length (tokens)", ylabel="needle depth", scale=1,
                    colorbar="accuracy", digits=2, title=title or "passkey retrieval", writer=writer)


def plot_scores(results: list[dict], tasks: list[str], output: Path, title: str, *, writer: str = "sparse-ft") -> Path:
    """RULER's scores (0-100), tasks x lengths, with the mean over tasks as the last row."""
    lengths = sorted({r["length"] for r in results})
    score = {(r["task"], r["length"]): r["score"] for r in results}
    grid = [[score[(t, n)] for n in lengths] for t in tasks]
    grid.append([sum(column) / len(column) for column in zip(*grid)])
    return _heatmap(grid, output, columns=[_tokens(n) for n in lengths], rows=[*tasks, "mean"],
                    xlabel="length (tokens)", ylabel="task", scale=100, colorbar="score", digits=0, title=title,
                    writer=writer, summary_row=True)
