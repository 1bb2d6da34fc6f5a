"""Plots a reader can trust: log-axis ticks at both ends of the data, titles naming the model,
quantised runs labelled as such, and the experiment's plots redrawn from its results alone."""

import argparse
import json

import pytest

from sparse_ft.evaluation import plots, report
from sparse_ft.evaluation.cli import _label
from sparse_ft.files.outputs import written_by


@pytest.mark.parametrize("low, high", [(2.8, 35.0), (3.1, 4.2), (1.02, 1.09), (1.5, 9000.0), (10.0, 10.0)])
def test_log_ticks_span_the_data(low, high):
    ticks = plots.log_ticks(low, high)
    assert ticks[0] <= low and ticks[-1] >= high and ticks == sorted(set(ticks))
    assert 2 <= len(ticks) <= 12 or low == high
    inside = [t for t in ticks if low <= t <= high]
    assert len(inside) >= 1 or ticks[-1] / ticks[0] < 1.3  # labels fall on the data, not only around it


def test_the_committed_plots_complaint_is_fixed():
    """PPL from 2.8 to 35 had no tick above 20: now 30 and 50 are labelled."""
    ticks = plots.log_ticks(2.8, 35.0)
    assert 30 in ticks and ticks[-1] == 50 and ticks[0] == 2


def test_quantised_runs_are_labelled(tmp_path):
    args = argparse.Namespace(label=None, method="full", adapter=None, load_in_4bit=True, load_in_8bit=False)
    assert _label(args, "full") == "full (NF4)"
    int8 = argparse.Namespace(**(vars(args) | {"load_in_4bit": False, "load_in_8bit": True, "adapter": str(tmp_path / "run" / "adapter")}))
    assert _label(int8, "full") == "full + adapter (LLM.int8)"
    assert _label(argparse.Namespace(**(vars(args) | {"label": "mine"})), "full") == "mine"


def test_eval_plot_titles_name_the_models(tmp_path, capsys, monkeypatch):
    from sparse_ft.cli import main

    titles, draw = [], plots.plot_ppl
    monkeypatch.setattr(plots, "plot_ppl", lambda *a, **k: titles.append(k["title"]) or draw(*a, **k))

    rows = [{"length": 64, "ppl": 3.0}, {"length": 128, "ppl": 30.0}]
    for name, model in (("a", "tiny"), ("b", str(tmp_path))):
        (tmp_path / f"{name}.json").write_text(json.dumps({"label": name, "results": rows, "config": {"model": model}}))
    assert report.read_ppl(tmp_path / "b.json") == ("b", rows, tmp_path.name)
    out = tmp_path / "both.png"
    assert main(["eval", "plot", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output", str(out)]) == 0
    assert written_by(out) == "sparse-ft eval plot" and out.stat().st_size > 1000
    assert titles == [f"perplexity: {tmp_path.name}, tiny (random weights)"]


def test_heatmaps_are_readable_without_red_green(tmp_path, monkeypatch):
    """Passkey and RULER heatmaps use a colour-blind-safe, perceptually uniform map (not
    RdYlGn), label both axes and the colour bar, and write each value in a colour that
    contrasts with its cell: white on a failed (dark) cell, black on a solved (bright) one."""
    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a: figures.append(fig) or save(fig, *a))
    cells = [{"length": n, "depth": d, "accuracy": float(n == 256)} for n in (256, 512) for d in (0.0, 1.0)]
    plots.plot_passkey(cells, tmp_path / "passkey.png", "passkey: tiny-base")
    scores = [{"task": t, "length": n, "score": 100.0 * (n == 256)} for t in ("niah_single_1", "fwe") for n in (256, 512)]
    plots.plot_scores(scores, ["niah_single_1", "fwe"], tmp_path / "ruler.png", "RULER: tiny-base")
    for fig in figures:
        ax, bar = fig.axes
        assert ax.images[0].get_cmap().name == plots.HEATMAP_CMAP == "viridis"
        assert ax.get_xlabel() and ax.get_ylabel() and bar.get_ylabel() and ax.get_title()
        ink = {text.get_text(): text.get_color() for text in ax.texts}
        assert {ink[k] for k in ink if float(k) == 0} == {"white"} and {ink[k] for k in ink if float(k) > 0} == {"black"}
