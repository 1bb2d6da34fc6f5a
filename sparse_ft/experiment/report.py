"""Tables and pictures of ``sparse-ft experiment`` results: fine-tuned rows shaped like SCCA's
Table 2 (PPL at 1x-4x after PI + LoRA+ through each training pattern, mean and spread over
seeds), training-free rows like DCA's Table 1 (PPL far past the pretraining length), passkey
accuracy per length, RULER's mean per length and effective context length per row, a "transfer to full
attention" table (each pattern and its variants at the target: full attention against the training
pattern, passkey, RULER, step time) and the option it recommends per pattern, short-context retention (scores at C as shares of the base's),
a PPL-vs-length plot and, per row, a passkey heatmap (depth x length) and a RULER heatmap (task x
length)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Callable, Optional

from sparse_ft.evaluation.plots import plot_passkey, plot_ppl, plot_scores
from sparse_ft.evaluation.report import write_json
from sparse_ft.files.outputs import atomic_file
from sparse_ft.modeling.rope import SCALINGS


def _shown(path: str) -> str:
    """A path inside the working directory as relative: the tables read the same in every clone."""
    p = Path(path)
    return str(p.relative_to(Path.cwd())) if p.is_absolute() and p.is_relative_to(Path.cwd()) else path


def _group(row: dict) -> str:
    """A fine-tuned row's pattern, with its variant (``s2+sinks``): its name but the seed."""
    return f"{row['pattern']}+{row['variant']}" if row.get("variant") else row["pattern"]


def _by_pattern(rows: list[dict]) -> dict[str, list[dict]]:
    """The fine-tuned rows by pattern and variant (each variant after its pattern, as run)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["kind"] == "fine-tuned":
            groups[_group(row)].append(row)
    return groups


def _ppl(row: dict) -> dict[int, float]:
    return {r["length"]: r["ppl"] for r in row["ppl"]}


def _passkey(row: dict) -> dict[int, float]:
    acc: dict[int, list[float]] = defaultdict(list)
    for c in row["passkey"]:
        acc[c["length"]].append(c["accuracy"])
    return {n: mean(v) for n, v in acc.items()}


def _ruler(row: dict) -> dict[int, float]:
    """RULER's mean over its tasks per length ({} for a row measured without RULER)."""
    return {m["length"]: m["mean"] for m in row.get("ruler", {}).get("summary", {}).get("means", [])}


def _effective(rows: list[dict], which: str) -> str:
    """Each row's effective length, seeds apart: a mean of lengths is no length."""
    from sparse_ft.evaluation.effective_length import brief

    return " / ".join(brief(r["ruler"]["summary"]["effective_length"][which]) for r in rows)


def _ruler_table(rows: list[dict], groups: dict[str, list[dict]]) -> list[str]:
    """RULER's mean per length and both effective lengths: fine-tuned patterns (mean ±
    half-range over seeds; effective lengths per seed), then the training-free rows."""
    measured = [r for r in rows if _ruler(r)]
    if not measured:
        return []
    first = measured[0]["ruler"]
    summary, lengths = first["summary"], sorted({n for r in measured for n in _ruler(r)})
    relative = summary["effective_length"]["relative"]
    base = summary["base"]
    rel = (f"mean >= {relative['fraction']:g} x the base's {base['mean']:.1f} at {base['length']}" if base
           else f"n/a: {relative['note']}")
    samples = first["rows"][0]["samples"]
    out = ["## RULER: mean score per length and effective context length", "",
           f"Tasks {', '.join(summary['tasks'])}; {samples} samples per task and length, greedy, scored as RULER "
           f"scores them; fine-tuned rows with full attention. Effective length: the longest length whose mean is "
           f">= {summary['effective_length']['ruler']['threshold']:g} (RULER's threshold); relative: {rel}. "
           "`≥N`: N is the longest evaluated; fine-tuned rows list each seed; —: a length the row was not measured at.", "",
           "| row | " + " | ".join(f"mean@{n}" for n in lengths) + " | effective (85.6) | relative |",
           "|---|" + "---:|" * len(lengths) + "---|---|"]
    for pattern, group in groups.items():
        if all(_ruler(r) for r in group):
            cells = [_cell(_values(group, lambda r: _ruler(r).get(n)), 1) if any(n in _ruler(r) for r in group) else "—"
                     for n in lengths]  # "—": a length the row's kind is not measured at
            out.append(f"| {pattern} (fine-tuned) | " + " | ".join(cells)
                       + f" | {_effective(group, 'ruler')} | {_effective(group, 'relative')} |")
    for r in rows:
        if r["kind"] == "training-free" and _ruler(r):
            out.append(f"| {r['name']} | " + " | ".join(f"{_ruler(r)[n]:.1f}" if n in _ruler(r) else "—" for n in lengths)
                       + f" | {_effective([r], 'ruler')} | {_effective([r], 'relative')} |")
        elif "not_run" in r.get("ruler", {}):
            out.append(f"| {r['name']} | " + " | ".join("—" for _ in lengths) + " | n/a | n/a |")
    out.append("")
    out += [f"{r['name']}: not run: {r['ruler']['not_run']}" for r in rows if "not_run" in r.get("ruler", {})]
    return out + [""]


def _spread(values: list[float], digits: int) -> str:
    """mean ± half the range over seeds (with two seeds: ± half their difference)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{mean(values):.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def _values(group: list[dict], value: Callable[[dict], Optional[float]]) -> Optional[list[float]]:
    """``value`` of each row of a pattern's ``group`` (its seeds); None where a seed has none
    (a row made before that value was recorded, a length not evaluated)."""
    values = [value(r) for r in group]
    return None if any(v is None for v in values) else [v for v in values if v is not None]


def _cell(values: Optional[list[float]], digits: int) -> str:
    return "n/a" if values is None else _spread(values, digits)


def _step_ratio(group: list[dict], cost: dict[str, dict]) -> Optional[float]:
    """A variant's step over its plain pattern's, median of the interleaved rounds
    (``step_cost.json``); 1 for a plain pattern; None where not measured."""
    return cost.get(_group(group[0]), {}).get("ratio") if group[0].get("variant") else 1.0


def _transfer_table(groups: dict[str, list[dict]], target: int, cost: dict[str, dict]) -> list[str]:
    """Transfer to full attention (issue 34): per pattern and variant, PPL at the target with
    full attention and through the training pattern, the first over full-attention
    fine-tuning's (where ``full`` was trained), passkey's and RULER's means at the target (mean
    ± half-range over seeds), the run's mean step time, and a variant's step over its plain
    pattern's from ``cost`` (:func:`_step_ratio`)."""
    def at_target(r: dict) -> Optional[float]:
        return _ppl(r).get(target)

    full = _values(groups.get("full", []), at_target)
    reference = mean(full) if full else None
    out = [f"## Transfer to full attention: each pattern and its variants at {target}", "",
           "PPL with full attention (how a model trained through a pattern is served) against the same model "
           "through its training pattern (with its dense layers); "
           + (f"\"÷ full FT\": the first over full-attention fine-tuning's ({reference:.3f}); " if reference else "")
           + "passkey and RULER means at the same length, with full attention; step s: the run's mean step "
           "(its training log); step × plain: a variant's step over its plain pattern's, timed in one process, "
           "interleaved (median of the rounds, step_cost.json).", "",
           "| training pattern | variant | PPL full attention | PPL own pattern | " + ("÷ full FT | " if reference else "")
           + "passkey | RULER | step s | step × plain |",
           "|---|---|" + "---:|" * (6 + bool(reference))]
    for group in groups.values():
        first, ppl = group[0], _values(group, at_target)
        cells = [_cell(ppl, 3), _cell(_values(group, lambda r: r["ppl_own_pattern"]["ppl"]), 3)]
        if reference:
            cells.append("n/a" if ppl is None else f"{mean(ppl) / reference:.3f}")
        cells += [_cell(_values(group, lambda r: _passkey(r).get(target)), 2),
                  _cell(_values(group, lambda r: _ruler(r).get(target)), 1),
                  _cell(_values(group, lambda r: r.get("step_seconds")), 3),
                  ("n/a" if (ratio := _step_ratio(group, cost)) is None else f"{ratio:.2f}") if first.get("variant") else "—"]
        out.append(f"| {first['pattern']} | {first.get('variant') or '—'} | " + " | ".join(cells) + " |")
    variants = {r["variant"]: r["overrides"] for g in groups.values() for r in g if r.get("variant")}
    if variants:
        out += ["", "Variants: " + "; ".join(f"{name} = {', '.join(o)}" for name, o in variants.items()) + "."]
    return out + [""]


# Issue 34's goal for a training option (a pattern alone or with a variant) served with full
# attention at the target: PPL within 5 % of full-attention fine-tuning's, passkey and RULER means
# within 0.05 of its (RULER on its 0-1 scale), at no more than 1.15x the plain pattern's step.
GOAL_PPL_RATIO, GOAL_SCORE_GAP, GOAL_STEP_RATIO = 1.05, 0.05, 1.15


def _option(group: list[dict], target: int, full: dict[str, float], cost: dict[str, dict]) -> Optional[dict[str, float]]:
    """One training option's distance from full fine-tuning at ``target`` (seed means) and its
    step over its plain pattern's; None where a value was not measured."""
    ppl, pk = _values(group, lambda r: _ppl(r).get(target)), _values(group, lambda r: _passkey(r).get(target))
    ruler = _values(group, lambda r: _ruler(r).get(target))
    step = _step_ratio(group, cost)
    if not (ppl and pk and ruler and step):
        return None
    return {"ppl": mean(ppl) / full["ppl"], "passkey": mean(pk) - full["passkey"],
            "ruler": (mean(ruler) - full["ruler"]) / 100, "step": step}


def _meets(o: dict[str, float]) -> bool:
    return (o["ppl"] <= GOAL_PPL_RATIO and o["passkey"] >= -GOAL_SCORE_GAP and o["ruler"] >= -GOAL_SCORE_GAP
            and o["step"] <= GOAL_STEP_RATIO)


def _recommendation(groups: dict[str, list[dict]], target: int, cost: dict[str, dict]) -> list[str]:
    """Per training pattern, the option to train with for a model served with full attention:
    the cheapest that meets the goal (the ``GOAL_`` constants), else the closest in PPL among those
    within the step budget, and the best in PPL at any cost where that is another option.
    Empty without a full-attention fine-tuned row (nothing to be within)."""
    reference = groups.get("full")
    if not reference:
        return []
    full = {"ppl": mean(_ppl(r)[target] for r in reference), "passkey": mean(_passkey(r)[target] for r in reference),
            "ruler": mean(_ruler(r).get(target, 0.0) for r in reference)}
    options: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for group in groups.values():
        first = group[0]
        measured = _option(group, target, full, cost)
        if first["pattern"] != "full" and measured:
            options[first["pattern"]][first.get("variant") or "alone"] = measured
    if not options:
        return []
    out = [f"## Recommendation per pattern: which option transfers to full attention at {target}", "",
           f"Goal: served with full attention, PPL within {GOAL_PPL_RATIO - 1:.0%} of full-attention fine-tuning's, "
           f"passkey and RULER means within {GOAL_SCORE_GAP} of its (RULER on a 0-1 scale), at ≤ {GOAL_STEP_RATIO}× the "
           "plain pattern's training step. Recommended: the cheapest option that meets it, else the closest in PPL "
           "within the step budget. Differences are of seed means.", "",
           "| training pattern | recommended | PPL ÷ full FT | passkey − full FT | RULER − full FT | step × plain | goal |",
           "|---|---|---:|---:|---:|---:|---|"]
    notes = []
    for pattern, by_name in options.items():
        meeting = sorted((o["step"], name) for name, o in by_name.items() if _meets(o))
        affordable = sorted((o["ppl"], name) for name, o in by_name.items() if o["step"] <= GOAL_STEP_RATIO)
        best = min(by_name, key=lambda name: by_name[name]["ppl"])
        name = meeting[0][1] if meeting else affordable[0][1] if affordable else best
        o = by_name[name]
        out.append(f"| {pattern} | {name} | {o['ppl']:.3f} | {o['passkey']:+.2f} | {o['ruler']:+.2f} | {o['step']:.2f} | "
                   + ("met" if meeting else "not met: closest") + " |")
        if best != name:
            b = by_name[best]
            notes.append(f"{pattern}: {best} is closer in PPL ({b['ppl']:.3f}× full FT, passkey {b['passkey']:+.2f}, "
                         f"RULER {b['ruler']:+.2f}) at {b['step']:.2f}× the plain step.")
    return out + ([""] + ["At any cost: " + " ".join(notes)] if notes else []) + [""]


def _retention_table(rows: list[dict], groups: dict[str, list[dict]], context: int) -> list[str]:
    """Short-context retention: each fine-tuned row's scores at the base's own context C as a
    share of the unchanged base's there (1.00: nothing lost). PPL's share is the base's over the
    row's, so that lower is worse in every column; the base's scores are the ``vanilla`` row's
    and RULER's base measurement, and a column whose base was not measured reads n/a."""
    vanilla = next((r for r in rows if r["kind"] == "training-free" and r.get("method") == "full" and not r["params"]), None)
    base_ppl = _ppl(vanilla).get(context) if vanilla else None
    base_pk = _passkey(vanilla).get(context) if vanilla else None
    ruler_base = next((r["ruler"]["summary"]["base"] for r in rows if _ruler(r) and r["ruler"]["summary"].get("base")), None)

    def share(value: Callable[[dict], Optional[float]], base: Optional[float], invert: bool = False) -> Callable:
        def of(r: dict) -> Optional[float]:
            v = value(r)
            if v is None or not base:
                return None
            return base / v if invert else v / base
        return of

    columns = [share(lambda r: _ppl(r).get(context), base_ppl, invert=True), share(lambda r: _passkey(r).get(context), base_pk),
               share(lambda r: _ruler(r).get(context), ruler_base["mean"] if ruler_base else None)]
    base_cells = [f"{base_ppl:.3f}" if base_ppl else "n/a", f"{base_pk:.2f}" if base_pk is not None else "n/a",
                  f"{ruler_base['mean']:.1f}" if ruler_base else "n/a"]
    out = [f"## Short-context retention: scores at C = {context} as a share of the base's", "",
           f"The base's: PPL {base_cells[0]}, passkey {base_cells[1]}, RULER mean {base_cells[2]} (full attention). "
           "PPL's share is the base's PPL over the row's; passkey's and RULER's the row's score over the base's. "
           "Mean ± half-range over seeds.", "",
           "| training pattern | variant | PPL | passkey | RULER |", "|---|---|---:|---:|---:|"]
    for group in groups.values():
        first = group[0]
        out.append(f"| {first['pattern']} | {first.get('variant') or '—'} | "
                   + " | ".join(_cell(_values(group, column), 2) for column in columns) + " |")
    return out + [""]


def _mean_cells(rows: list[dict]) -> list[dict]:
    acc: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        for c in row["passkey"]:
            acc[(c["length"], c["depth"])].append(c["accuracy"])
    return [{"length": n, "depth": d, "accuracy": mean(v)} for (n, d), v in sorted(acc.items())]


def _mean_scores(rows: list[dict]) -> list[dict]:
    """RULER's score per task and length, the mean over ``rows`` (a pattern's seeds)."""
    acc: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        for r in row["ruler"]["rows"]:
            acc[(r["task"], r["length"])].append(r["score"])
    return [{"task": t, "length": n, "score": mean(v)} for (t, n), v in acc.items()]


def tables(results: dict) -> str:
    rows, context, target = results["rows"], results["context"], results["target"]
    cfg = results["config"]
    out = [f"# Tiny-scale experiment: {context} -> {target} tokens", "",
           f"Base: `{_shown(cfg['base'])}` (context {context}). Fine-tuning: "
           f"{SCALINGS[cfg.get('rope_method', 'linear')]} to {target} + LoRA+ through each pattern, "
           f"{cfg['steps']} steps each, seeds {cfg['seeds']}; evaluation with full attention, standard sliding-window "
           f"PPL (stride {context}, {cfg['ppl_windows']} windows per length) on held-out stdlib modules; passkey: "
           f"{cfg['passkey_trials']} keys x depths {cfg['passkey_depths']}, greedy, exact match. "
           f"Training + evaluation of all rows {results['row_seconds'] / 60:.1f} min; this invocation "
           f"{results['wall_seconds'] / 60:.1f} min (finished rows and adapters are reused).", ""]
    groups = _by_pattern(rows)
    if groups:
        ppl_lengths = sorted({n for g in groups.values() for r in g for n in _ppl(r)})
        pk_lengths = sorted({n for g in groups.values() for r in g for n in _passkey(r)})
        out += ["## Fine-tuned (SCCA Table 2 shape): PPL, mean ± half-range over seeds", "",
                "Evaluated with full attention; the column \"own pattern\" evaluates the same model at "
                f"{target} through the pattern it was trained with.", "",
                "| training pattern | " + " | ".join(f"PPL@{n}" for n in ppl_lengths) + f" | PPL@{target} own pattern | "
                + " | ".join(f"passkey@{n}" for n in pk_lengths) + " | final loss | train s/run | step s |",
                "|---|" + "---:|" * (len(ppl_lengths) + len(pk_lengths) + 4)]
        for pattern, group in groups.items():
            cells = [_spread([_ppl(r)[n] for r in group], 3) for n in ppl_lengths]
            cells.append(_spread([r["ppl_own_pattern"]["ppl"] for r in group], 3))
            cells += [_spread([_passkey(r)[n] for r in group], 2) for n in pk_lengths]
            cells += [_spread([r["final_loss"] for r in group], 3), f"{mean(r['train_seconds'] for r in group):.0f}",
                      _cell(_values(group, lambda r: r.get("step_seconds")), 3)]
            out.append(f"| {pattern} | " + " | ".join(cells) + " |")
        cost = results.get("step_cost", {}).get("options", {})
        out += ([""] + _transfer_table(groups, target, cost) + _recommendation(groups, target, cost)
                + _retention_table(rows, groups, context))
    free = [r for r in rows if r["kind"] == "training-free"]
    if free:
        lengths = sorted({c["length"] for r in free for c in r["passkey"]})
        out += ["## Training-free on the base (DCA Table 1 shape): PPL", "",
                "| method | " + " | ".join(f"PPL@{n}" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for r in free:
            ppl = _ppl(r)
            out.append(f"| {r['name']} | " + " | ".join(f"{ppl[n]:.3f}" if n in ppl else "n/a" for n in lengths) + " |")
        out += ["", "## Training-free on the base: passkey accuracy (mean over depths)", "",
                "| method | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
        for r in free:
            acc = _passkey(r)
            out.append(f"| {r['name']} | " + " | ".join(f"{acc[n]:.2f}" for n in lengths) + " |")
        out.append("")
    return "\n".join(out + _ruler_table(rows, groups))


# What says how this invocation ran rather than what the rows hold.
INVOCATION_FIELDS = ("wall_seconds", "machine")


def _unchanged(results: dict, path: Path) -> bool:
    """``path`` already records ``results``: the same settings and rows, whatever this
    invocation's wall time and machine (all rows were reused)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: written afresh
        return False
    fresh = json.loads(json.dumps(results))  # tuples as lists, as read back
    return all(recorded.get(k) == fresh.get(k) for k in fresh.keys() | recorded.keys() if k not in INVOCATION_FIELDS)


def write_report(results: dict, out: Path) -> None:
    """results.json, tables.md and the plots; a rerun that changed nothing rewrites none of
    them (they are committed: a clone that reruns the experiment stays clean)."""
    out = Path(out)
    if _unchanged(results, out / "results.json"):
        print(f"{out}: every row was reused and the results are unchanged; results.json, tables.md and plots kept "
              "(--replot redraws the plots)")
        return
    write_json(out / "results.json", results)
    with atomic_file(out / "tables.md") as f:
        f.write(tables(results))
    draw(results, out)
    print(f"wrote {out / 'results.json'}, {out / 'tables.md'} and plots")


def draw(results: dict, out: Path) -> list[Path]:
    """Every plot of ``results`` into ``out``: PPL vs length (plain patterns and training-free
    rows: the variants' lines would hide them), a passkey heatmap per row and a
    RULER heatmap per row measured with RULER (fine-tuned rows: the mean of their seeds). Titles
    name the base and what each row did; the tables are not touched, so plots can be redrawn
    from a finished ``results.json`` (``sparse-ft experiment --replot``)."""
    out, cfg = Path(out), results["config"]
    base, context, target = Path(cfg["base"]).name, results["context"], results["target"]
    rope = SCALINGS[cfg.get("rope_method", "linear")]
    seeds = f"mean of seeds {', '.join(map(str, cfg['seeds']))}"
    drawn, series = [], []
    for pattern, group in _by_pattern(results["rows"]).items():
        lengths = sorted(_ppl(group[0]))
        if not group[0].get("variant"):  # the plain patterns: their variants' PPL is in the transfer table
            series.append((f"{pattern} (FT)", [{"length": n, "ppl": mean(_ppl(r)[n] for r in group)} for n in lengths]))
        what = f"{base} fine-tuned to {target} ({rope} + LoRA+)\nthrough {pattern}, {seeds}"
        drawn.append(plot_passkey(_mean_cells(group), out / f"passkey_ft_{pattern}.png", f"passkey, {what}"))
        if all(_ruler(r) for r in group):
            drawn.append(plot_scores(_mean_scores(group), group[0]["ruler"]["summary"]["tasks"],
                                     out / f"ruler_ft_{pattern}.png", f"RULER, {what}, full attention"))
    free = [r for r in results["rows"] if r["kind"] == "training-free"]
    for row in free:
        if row["ppl"]:
            series.append((row["name"], row["ppl"]))
        what = f"{base} (context {context}), training-free: {row['name']}"
        drawn.append(plot_passkey(row["passkey"], out / f"passkey_free_{row['name']}.png", f"passkey, {what}"))
        if _ruler(row):
            drawn.append(plot_scores(_mean_scores([row]), row["ruler"]["summary"]["tasks"],
                                     out / f"ruler_free_{row['name']}.png", f"RULER, {what}"))
    if series:
        tuned = _by_pattern(results["rows"])
        both = bool(tuned and free)  # then say which lines are which
        parts = [f"fine-tuned to {target} ({rope} + LoRA+, {seeds})" + (", solid" if both else "")] if tuned else []
        parts += ["training-free on the base" + (", broken lines" if both else "")] if free else []
        title = f"{base} (pretrained at {context} tokens): perplexity vs length\n" + "; ".join(parts)
        drawn.append(plot_ppl(series, out / "ppl_vs_length.png", dashed=[r["name"] for r in free], title=title))
    return drawn
