"""``sparse-ft experiment``: the papers' tables at laptop scale.

The tiny base model (``assets/tiny-base-bpe``: BPE tokens, pretrained at C = 1,024 to retrieve
by construction, issue 33) is extended to 4C with position interpolation (or YaRN) + LoRA+
through each training pattern on an identical budget and two seeds (SCCA's Table 2), and
measured beside the training-free methods on the unchanged base out to 8C (DCA's Table 1). The
full run adds, per sparse training pattern, its :data:`VARIANTS` (with sink tokens, as SF-Attn,
with a dense last layer, with a dense tail), each step timed against its plain pattern's, interleaved (issue
34). Everything is measured the same way: full attention at evaluation, standard sliding-window
PPL on held-out stdlib modules, passkey retrieval over lengths x depths, RULER's offline tasks.
Training and evaluation are the project's own (``train.py``'s loop, ``sparse_ft.evaluation``);
this module only schedules them and tabulates.

Each finished row is written to ``rows/<name>.json`` at once and reused by a rerun with the
same settings, so an interrupted experiment resumes where it stopped. The results folder is
the experiment's own (``claim_directory``: new, empty, or an earlier experiment's); neither it
nor the runs folder may overlap the base or the recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from sparse_ft import console
from sparse_ft.config.paths import BPE_BASE_DIR, RECIPE_DIRS, REPO_ROOT
from sparse_ft.modeling.rope import SCALINGS

if TYPE_CHECKING:
    from attn_patterns.base import Pattern
    from sparse_ft.config import Recipe
    from sparse_ft.methods import Method

HELP = "the tiny base extended 4x by every pattern and training-free method: tables, plots"
WRITER = "sparse-ft experiment"
RECIPE = RECIPE_DIRS[0] / "experiment" / "tiny_4x.yaml"
# The training-free rows: the unchanged base ("vanilla"), then every method that does not
# train, at its defaults but for the settings a 1,024-token base needs, each followed by its
# ablation rows: a new method in sparse_ft.methods gets its row with no change here.
# LongHeads: the paper's chunks of 256 are a sixteenth of Llama-2's 4,096-token window; so are 64 of C = 1,024
TINY_BASE_PARAMS: dict[str, dict] = {"longheads": {"chunk_size": 64}}
# DCA's Figure 4 (intra-chunk alone, then with inter-chunk attention), DCA as the serving
# engines run it for Qwen's dual_chunk_attention_config (chunk length s - w, logit scaling), and
# LongHeads as the paper's text states it (our default keeps the previous chunk, as the authors' code).
ABLATIONS: dict[str, dict[str, dict]] = {
    "dca": {"dca_intra": {"pieces": "intra"}, "dca_intra_inter": {"pieces": "intra+inter"},
            "dca_qwen": {"variant": "qwen"}},
    "longheads": {"longheads_paper": {"keep_previous": False}},
}
@dataclass(frozen=True)
class Variant:
    """A variant row (issue 34: what carries training through a pattern over to full
    attention): a trained pattern's recipe with ``overrides`` (recipe ``key=value``) on top,
    fine-tuned on the same seeds, evaluated like the plain row, and timed against it."""

    overrides: tuple[str, ...]
    why: str
    applies: Callable[[str, list[str]], bool]  # (a trained pattern, the run's patterns) -> it gets this row


def _pattern(name: str) -> Optional[Pattern]:
    """The registered pattern ``name`` at its defaults; None for a method that is no pattern
    (``full``: no pattern for dense layers or tails to replace, no sinks to add)."""
    from sparse_ft import methods

    method = methods.get(name)
    return method.pattern if isinstance(method, methods.PatternMethod) else None


def _sparse(pattern: str, trained: list[str]) -> bool:
    return _pattern(pattern) is not None


def _without_sinks(pattern: str, trained: list[str]) -> bool:
    found = _pattern(pattern)
    return found is not None and not found.sink_tokens  # sf_attn has its own


def _s2_unless_sf_attn_trained(pattern: str, trained: list[str]) -> bool:
    return pattern == "s2" and "sf_attn" not in trained


SINK_TOKENS = 4  # StreamingLLM's count, which SinkLoRA builds on (sf_attn's default)
# The full run's variant rows, in the order (the quick run has none): name -> overrides.
VARIANTS: dict[str, Variant] = {
    "sinks": Variant((f"attention.params.sink_tokens={SINK_TOKENS}",),
                     f"every query also sees the first {SINK_TOKENS} keys (StreamingLLM's sink tokens)", _without_sinks),
    # SF-Attn is S² reassembled, with sink tokens (sf_attn with sink_tokens=0 is s2): S²'s row, timed against it
    "sf_attn": Variant(("attention.pattern=sf_attn",), "SinkLoRA's SF-Attn in S²'s place (one row, unless sf_attn "
                       "is a trained pattern itself)", _s2_unless_sf_attn_trained),
    "dense_last": Variant(("attention.dense_layers=last 1",), "the last layer attends fully, the others run the "
                          "pattern (MoBA's hybrid layers)", _sparse),
    "dense_tail": Variant(("train.dense_final_fraction=0.1",), "the last tenth of the steps with full attention in "
                          "every layer (MoBA's and InfLLM-v2's switch)", _sparse),
}


def trained_patterns() -> list[str]:
    """The fine-tuned rows: full attention, then the patterns SCCA's Table 2 fine-tunes, those
    registered with the tag ``scca_table2`` (S², SCCA fixed, SCCA flow, LongMixed). A selection,
    not every trainable name: ``sda`` is LongMixed's component and ``mixed`` needs its parts."""
    import attn_patterns

    return ["full", *attn_patterns.PATTERNS.names(tag="scca_table2")]


def ruler_tasks() -> list[str]:
    """The registered RULER tasks, in their order: every one fits the base's context (a base
    whose context some task's shortest prompt exceeds is refused, naming both)."""
    from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks

    return registered_ruler_tasks()


def free_methods() -> dict[str, tuple[str, dict]]:
    """Row label -> (evaluation method, its parameters)."""
    from sparse_ft import methods

    rows = {"vanilla": ("full", {})}
    for name in methods.names(lambda supports: not supports.training):
        tiny = TINY_BASE_PARAMS.get(name, {})
        rows[name] = (name, tiny)
        rows.update({label: (name, {**tiny, **params}) for label, params in ABLATIONS.get(name, {}).items()})
    return rows


@dataclass
class ExperimentConfig:
    base: str = str(BPE_BASE_DIR)
    output: str = "results/experiment"  # JSON, tables, plots: small enough to commit
    runs: str = "runs/experiment"  # adapters and training logs
    recipe: str = str(RECIPE)
    factor: int = 4  # fine-tuning target = factor x the base's context
    rope_method: str = "linear"  # how fine-tuning extends RoPE: PI (the papers'), or dynamic NTK / YaRN
    patterns: list[str] = field(default_factory=trained_patterns)
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))  # per pattern, where one applies
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    steps: int = 150  # one 4,096-token sequence each: ~2.5 min per run on 2 cores
    ppl_factors: list[int] = field(default_factory=lambda: [1, 2, 4])
    passkey_factors: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    free_methods: list[str] = field(default_factory=lambda: list(free_methods()))
    free_factors: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    ppl_windows: int = 16  # windows per length; stride = the base's context
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 5
    ruler_tasks: list[str] = field(default_factory=ruler_tasks)  # [] leaves RULER out
    ruler_factors: list[int] = field(default_factory=lambda: [1, 2, 4])  # fine-tuned rows: C (retention) to the target
    ruler_free_factors: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # training-free rows
    ruler_samples: int = 3  # per task and length (RULER's runs use 500; each is a 128-token greedy answer here)
    data: str = ".cache/sparse-ft/experiment"  # fine-tuning corpus at the target length
    modules: Optional[list[str]] = None  # stdlib modules of the corpus (None: all; tests use a few)
    val_percent: float = 5.0

    def validate(self) -> None:
        from sparse_ft import methods
        from sparse_ft.files.outputs import file_in_the_way

        trainable = methods.names(lambda supports: supports.training)
        for p in self.patterns:
            if p not in trainable:
                raise ValueError(f"--patterns {p!r} is unknown; allowed: {', '.join(trainable)}")
        for v in self.variants:
            if v not in VARIANTS:
                raise ValueError(f"--variants {v!r} is unknown; allowed: {', '.join(VARIANTS)}")
        rows = free_methods()
        for m in self.free_methods:
            if m not in rows:
                raise ValueError(f"--free-methods {m!r} is unknown; allowed: {', '.join(rows)}")
        from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks

        for task in self.ruler_tasks:
            if task not in registered_ruler_tasks():
                raise ValueError(f"ruler_tasks {task!r} is unknown; allowed: {', '.join(registered_ruler_tasks())}")
        for key in ("factor", "steps", "ppl_windows", "passkey_trials", "ruler_samples"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)} must be >= 1")
        if not self.seeds:
            raise ValueError("--seeds must list at least one seed")
        if not Path(self.base, "config.json").is_file():
            raise FileNotFoundError(f"--base {self.base}: no checkpoint there (sparse-ft pretrain writes one)")
        for flag, value in (("--output", self.output), ("--runs", self.runs)):
            if (blocking := file_in_the_way(Path(value))) is not None:
                raise ValueError(f"{flag} {value}: {blocking} is a file; name a directory")


# The README's main command, within 3 minutes on 2 idle cores: one seed, two patterns (full
# attention and LongLoRA's S²) on a short budget, and the three training-free rows that show what
# the base can and cannot do past C (unchanged, DCA, YaRN), every row at C and 4C; no RULER (its
# 128-token answers at every length would take longer than the rest), no 8C (four fifths of the
# training-free rows' time) and no variant rows (one more fine-tuning each).
QUICK = dict(output="results/experiment-quick", runs="runs/experiment-quick", patterns=["full", "s2"], steps=20,
             seeds=[0], ppl_windows=4, ppl_factors=[1, 4], passkey_trials=2, passkey_depths=[0.0, 0.5, 1.0],
             passkey_factors=[1, 4], free_methods=["vanilla", "dca", "yarn"], free_factors=[1, 4], ruler_tasks=[],
             variants=[])


def portable(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every absolute path inside the repository written
    relative to it: row keys and the recorded settings are then the same in every clone, so a
    rerun elsewhere neither recomputes finished rows nor rewrites committed results. A path
    outside the repository stays as it is; what a path holds is keyed apart (``base_sha``)."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, (str, Path)) and Path(value).is_absolute() and Path(value).is_relative_to(REPO_ROOT):
        return Path(value).relative_to(REPO_ROOT).as_posix()
    return value


def _row_key(kind: str, settings: Any) -> str:
    return hashlib.sha256(json.dumps([kind, portable(settings)], sort_keys=True, default=str).encode()).hexdigest()[:16]


def evaluate(model, tokenizer, method, val, *, context: int, ppl_lengths: list[int], passkey_lengths: list[int],
             cfg: ExperimentConfig) -> dict:
    """Every row's evaluation, through the task registry ``eval`` runs too."""
    from sparse_ft.evaluation import tasks

    out: dict[str, Any] = {"ppl": [], "passkey": []}
    if method.supports.ppl:
        out["ppl"] = _ppl(val, ppl_lengths, context, cfg).evaluate(model, tokenizer, method)
    cells = tasks.get("passkey", lengths=passkey_lengths, depths=cfg.passkey_depths, trials=cfg.passkey_trials,
                      seed=0).evaluate(model, tokenizer, method)
    out["passkey"] = [{k: c[k] for k in ("length", "depth", "accuracy", "trials", "outputs", "keys")} for c in cells]
    return out


def training_pattern(recipe: Recipe) -> Method:
    """What a fine-tuned row is also evaluated through (``ppl_own_pattern``): the pattern it
    trained through, with its parameters and, under ``attention.dense_layers``, those layers
    attending fully, as they trained. A dense tail (``train.dense_final_fraction``) is no part
    of it: it ends the run with full attention in every layer, which the other columns measure."""
    from sparse_ft import methods

    att = recipe.attention
    method = methods.get(att.pattern, "attention.pattern", **att.params)
    return methods.with_dense_layers(method, att.dense_layers) if att.dense_layers else method


def step_seconds(summary: dict, recipe: Recipe) -> float:
    """A run's mean seconds per training step, from the trainer's per-step log (tokens per step
    / tokens per second), the first step left out where there are others: it carries one-off
    costs (the attention check, first allocations). A dense tail's steps count: they are the
    run's cost."""
    t = recipe.train
    tokens = t.per_device_batch_size * recipe.seq_len * t.gradient_accumulation_steps  # one process
    steps = summary["history"][1:] or summary["history"]
    return sum(tokens / h["tokens_per_s"] for h in steps) / len(steps)


def _ppl(val, lengths: list[int], context: int, cfg: ExperimentConfig):
    """Standard sliding-window PPL of the validation tokens, stride = the base's context."""
    from sparse_ft.evaluation import tasks

    return tasks.get("ppl", lengths=lengths, data=val, stride=context, max_windows=cfg.ppl_windows)


def base_context(base: str) -> int:
    """C, the base's pretraining context, as its config.json states it: transformers fills a
    missing ``max_position_embeddings`` with its class's default (2,048 for Llama), which would
    set every length of the experiment, silently."""
    from transformers import AutoConfig

    from sparse_ft.modeling.rope import original_context

    try:
        stated = json.loads((Path(base) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--base {base}: no readable config.json ({err})") from None
    rope = stated.get("rope_parameters") or stated.get("rope_scaling") or {}
    if "max_position_embeddings" not in stated and "original_max_position_embeddings" not in rope:
        raise ValueError(f"--base {base}: its config.json has no max_position_embeddings, so the base's context, from "
                         "which every length of the experiment derives, is unknown; add it")
    return original_context(AutoConfig.from_pretrained(base))


class Runner:
    def __init__(self, cfg: ExperimentConfig) -> None:
        from sparse_ft.files.outputs import check_apart, claim_directory

        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.output)
        for flag, output in (("--output", self.out), ("--runs", Path(cfg.runs))):
            check_apart(output, flag, {"--base": Path(cfg.base), "--recipe": Path(cfg.recipe)})
        self.context = base_context(cfg.base)  # before anything is written
        # results written before folders were marked have their rows
        claim_directory(self.out, WRITER, "--output", legacy=lambda found: (found / "rows").is_dir())
        (self.out / "rows").mkdir(exist_ok=True)
        self.target = self.context * cfg.factor
        self.jsonl: Optional[Path] = None  # the fine-tuning documents, once data() built them
        self.ruler_base: Optional[tuple[Optional[dict], str]] = None  # (measurement, why none), once measured

    def _cached(self, name: str, key: str) -> Optional[dict]:
        path = self.out / "rows" / f"{name}.json"
        if path.is_file():
            row = json.loads(path.read_text())
            if row.get("key") == key:
                console.say(f"reusing {path}")
                return row
        return None

    def _write(self, row: dict) -> dict:
        from sparse_ft.evaluation.report import write_json

        write_json(self.out / "rows" / f"{row['name']}.json", row)
        return row

    def data(self):
        """The fine-tuning corpus (blocks of the target length) and the validation tokens."""
        from sparse_ft.experiment.corpus import RETRIEVAL_FRACTION, build_corpus, write_jsonl
        from sparse_ft.data.packing import build_train_dataset
        from sparse_ft.evaluation.tokens import load_tokens
        from sparse_ft.modeling.model_io import load_tokenizer

        tokenizer = load_tokenizer(self.cfg.base)
        recipe = self._recipe("full", 0)
        blocks = self.cfg.steps * recipe.train.per_device_batch_size * recipe.train.gradient_accumulation_steps
        spec = _row_key("data", [self.target, blocks, self.cfg.modules, self.cfg.val_percent, RETRIEVAL_FRACTION])
        directory = Path(self.cfg.data) / f"ctx{self.target}-{spec}"
        if not (directory / "train.jsonl").is_file():
            build_corpus(directory, tokenizer, context=self.target, max_blocks=blocks + 8, modules=self.cfg.modules,
                         val_percent=self.cfg.val_percent)
            write_jsonl(directory, tokenizer)
        self.jsonl = directory / "train.jsonl"
        # tokenise and pack once here, so no run's training time includes it
        build_train_dataset(self._recipe("full", 0).data, tokenizer, self.target)
        return load_tokens(str(directory / "val.bin"), tokenizer, len(tokenizer))

    def _recipe(self, pattern: str, seed: int, output_dir: str = "runs/experiment", variant: Optional[str] = None):
        """The recipe of ``pattern``'s row for ``seed``, with ``variant``'s overrides on top."""
        from sparse_ft.config import load_recipe

        overrides = [f"model.name_or_path={self.cfg.base}", f"model.target_length={self.target}",
                     f"attention.pattern={pattern}", f"train.seed={seed}", f"train.output_dir={output_dir}",
                     f"train.max_steps={self.cfg.steps}", f"model.rope_method={self.cfg.rope_method}"]
        if self.jsonl is not None:
            overrides.append(f"data.source={self.jsonl}")
        return load_recipe(self.cfg.recipe, overrides + list(VARIANTS[variant].overrides if variant else ()))

    def _train(self, recipe, run_dir: Path) -> tuple[dict, float]:
        """Train, or reuse the adapter that a run of this exact recipe left: a change to the
        evaluation settings then costs no retraining."""
        from sparse_ft.evaluation.report import write_json
        from sparse_ft.train.trainer import train

        stamp = run_dir / "experiment_train.json"
        # the base is named by path in the recipe: its content decides too (a re-pretrained base)
        key = _row_key("train", {"recipe": recipe.to_dict(), "base_sha": _file_sha(Path(self.cfg.base) / "model.safetensors")})
        if stamp.is_file():
            done = json.loads(stamp.read_text())
            if done["key"] == key and Path(done["summary"]["adapter"], "adapter_config.json").is_file():
                console.say(f"reusing the adapter in {run_dir}")
                return done["summary"], done["train_seconds"]
            # the directory holds a finished run of other settings: this one starts afresh there
            # (only its checkpoints go)
            recipe.train.resume, recipe.train.overwrite_output_dir = "never", True
        else:  # an interrupted run of these settings (preempted, stopped) resumes: the trainer checks they match
            recipe.train.resume = "auto"
        began = time.perf_counter()
        with console.quieter():  # the progress bar names the row (console.row); -v prints each run's summary
            summary = train(recipe)
        seconds = time.perf_counter() - began
        write_json(stamp, {"key": key, "train_seconds": seconds, "summary": summary})
        return summary, seconds

    def fine_tuned(self, pattern: str, seed: int, val, variant: Optional[str] = None) -> dict:
        """The row of ``pattern`` fine-tuned on ``seed``, plain or as ``variant`` (a name of
        :data:`VARIANTS`; the row then names it and its overrides)."""
        from sparse_ft import methods
        from sparse_ft.evaluation import loading

        name = f"{pattern}{f'+{variant}' if variant else ''}-seed{seed}"
        run_dir = Path(self.cfg.runs) / name
        recipe = self._recipe(pattern, seed, str(run_dir), variant)
        key = self._fine_tuned_key(recipe, variant)
        if (row := self._cached(name, key)) is not None:
            def adapter():  # reused: only RULER may be missing
                return self._train(recipe, run_dir)[0]["adapter"]

            return self._with_ruler(row, lambda: loading.load(self.cfg.base, adapter()), methods.get("full"),
                                    self.cfg.ruler_factors)
        summary, train_seconds = self._train(recipe, run_dir)
        began = time.perf_counter()
        model, tokenizer = loading.load(self.cfg.base, summary["adapter"])
        ppl_lengths = [self.context * f for f in self.cfg.ppl_factors]
        passkey_lengths = [self.context * f for f in self.cfg.passkey_factors]
        result = evaluate(model, tokenizer, methods.get("full"), val, context=self.context, ppl_lengths=ppl_lengths,
                          passkey_lengths=passkey_lengths, cfg=self.cfg)
        # the same model through the pattern it was trained with: separates "learned the
        # longer context" from "carries over to full attention", which the papers assume
        own = _ppl(val, [self.target], self.context, self.cfg).evaluate(model, tokenizer, training_pattern(recipe))[0]
        row = {"name": name, "kind": "fine-tuned", "pattern": pattern, "seed": seed, "key": key,
               **({"variant": variant, "overrides": list(VARIANTS[variant].overrides)} if variant else {}),
               "train_seconds": train_seconds, "step_seconds": step_seconds(summary, recipe),
               "eval_seconds": time.perf_counter() - began,
               "final_loss": summary["final_loss"], "loss_curve": [h["loss"] for h in summary["history"]],
               "ppl_own_pattern": own, **result}
        return self._with_ruler(self._write(row), lambda: (model, tokenizer), methods.get("full"), self.cfg.ruler_factors)

    def training_free(self, label: str, val) -> dict:
        from sparse_ft import methods
        from sparse_ft.evaluation import loading

        name, params = free_methods()[label]
        method = methods.get(name, **params)
        key = self._free_key(method)
        if (row := self._cached(label, key)) is not None:
            return self._with_ruler(row, lambda: loading.load(self.cfg.base), method, self.cfg.ruler_free_factors)
        began = time.perf_counter()
        model, tokenizer = loading.load(self.cfg.base)
        lengths = [self.context * f for f in self.cfg.free_factors]
        result = evaluate(model, tokenizer, method, val, context=self.context, ppl_lengths=lengths,
                          passkey_lengths=lengths, cfg=self.cfg)
        row = {"name": label, "kind": "training-free", "method": name, "params": params, "key": key,
               "eval_seconds": time.perf_counter() - began, **result}
        return self._with_ruler(self._write(row), lambda: (model, tokenizer), method, self.cfg.ruler_free_factors)

    def _with_ruler(self, row: dict, load: Callable[[], tuple[Any, Any]], method, factors: list[int]) -> dict:
        """``row`` with RULER's scores and effective lengths at ``factors`` x C, measured apart
        from the rest of the row and cached under their own key: a change to RULER's settings
        (or RULER added to rows made without it) costs neither retraining nor PPL and passkey."""
        if not self.cfg.ruler_tasks:
            return row
        key = _row_key("ruler", {"tasks": self.cfg.ruler_tasks, "factors": factors,
                                 "samples": self.cfg.ruler_samples, "row": row["key"]})
        if row.get("ruler", {}).get("key") == key:
            return row
        began = time.perf_counter()
        model, tokenizer = load()
        measured, note = self._ruler_base(tokenizer)
        ruler = self._ruler([self.context * f for f in factors], base=measured, base_note=note)
        ruler.prepare(tokenizer)
        try:
            rows = ruler.evaluate(model, tokenizer, method)
        except ValueError as err:  # a method that cannot take these prompts (ParallelComp: a question longer than C)
            row["ruler"] = {"key": key, "not_run": str(err), "seconds": time.perf_counter() - began}
            return self._write(row)
        row["ruler"] = {"key": key, "rows": rows, "summary": ruler.summary_of(rows), "seconds": time.perf_counter() - began}
        return self._write(row)

    def _ruler(self, lengths: list[int], **base):
        from sparse_ft.evaluation.tasks.ruler import Ruler

        return Ruler(lengths, self.cfg.ruler_tasks, samples=self.cfg.ruler_samples, seed=0, **base)

    def _ruler_base(self, tokenizer) -> tuple[Optional[dict], Optional[str]]:
        """The base model's RULER mean at its own context C, with full attention, measured once
        per invocation for every row's relative effective length; None and the reason when C is
        shorter than the shortest prompt (the byte base of assets/tiny-base: 256 < 563)."""
        if self.ruler_base is None:
            from sparse_ft import methods
            from sparse_ft.evaluation import loading

            ruler = self._ruler([])
            ruler.prepare(tokenizer)
            model, _ = loading.load(self.cfg.base)
            self.ruler_base = (ruler.measure_base(model, tokenizer, methods.get("full")), ruler.base_note)
        measured, note = self.ruler_base
        return measured, None if measured is not None else note

    def _fine_tuned_key(self, recipe, variant: Optional[str] = None) -> str:
        # "ppl_own_pattern": rows written before that column existed are re-evaluated; rows
        # written before "step_seconds" are kept (a committed result stays unchanged: their step
        # time reads n/a); a variant's overrides are named too
        named = {"variant": list(VARIANTS[variant].overrides)} if variant else {}
        return _row_key("fine-tuned", {"recipe": recipe.to_dict(), **self._eval_settings(), "ppl_own_pattern": True,
                                       **named})

    def variants(self, pattern: str) -> list[str]:
        """The variant rows ``pattern`` gets: those of ``variants`` that apply to it."""
        return [v for v in self.cfg.variants if VARIANTS[v].applies(pattern, self.cfg.patterns)]

    def step_cost(self, options: dict[str, str]) -> Optional[dict]:
        """The step cost of each variant against its plain pattern (``options``: variant row
        name without the seed -> its plain pattern's), measured interleaved in this process
        (:mod:`sparse_ft.experiment.step_cost`) on the seed-0 recipes, cached in
        ``<output>/step_cost.json`` under a key of the recipes and the base: a rerun reuses it.
        None without variants."""
        from sparse_ft.evaluation.report import write_json
        from sparse_ft.experiment import step_cost

        if not options:
            return None
        names = list(dict.fromkeys([*options.values(), *options]))
        recipes = {}
        for name in names:
            pattern, _, variant = name.partition("+")
            recipes[name] = self._recipe(pattern, 0, variant=variant or None)
        key = _row_key("step_cost", {"recipes": {n: r.to_dict() for n, r in recipes.items()}, "warmup": step_cost.WARMUP,
                                     "repeats": step_cost.REPEATS,
                                     "base_sha": _file_sha(Path(self.cfg.base) / "model.safetensors")})
        path = self.out / "step_cost.json"
        if path.is_file() and (done := json.loads(path.read_text())).get("key") == key:
            console.say(f"reusing {path}")
            return done
        with console.row("step cost"):
            console.say(f"timing {len(names)} training options' steps interleaved ({step_cost.REPEATS} rounds)")
            done = {"key": key, "warmup": step_cost.WARMUP, "repeats": step_cost.REPEATS,
                    "options": step_cost.measure(recipes, options)}
        write_json(path, done)
        return done

    def _free_key(self, method) -> str:
        # keyed on every parameter, defaults included: a changed default is a new row, not a stale one
        return _row_key("training-free", {"method": repr(method), "base": self.cfg.base, **self._eval_settings()})

    def _eval_settings(self) -> dict:
        c = self.cfg
        return {"ppl_factors": c.ppl_factors, "passkey_factors": c.passkey_factors, "free_factors": c.free_factors,
                "ppl_windows": c.ppl_windows, "depths": c.passkey_depths, "trials": c.passkey_trials,
                "base_sha": _file_sha(Path(c.base) / "model.safetensors")}

    def run(self) -> dict:
        began = time.perf_counter()
        val = self.data()
        rows, options = [], {}
        for pattern in self.cfg.patterns:
            for seed in self.cfg.seeds:
                with console.row(f"{pattern}-seed{seed}"):  # every progress bar names the row it runs for
                    rows.append(self.fine_tuned(pattern, seed, val))
            for variant in self.variants(pattern):  # beside their pattern
                options[f"{pattern}+{variant}"] = pattern
                for seed in self.cfg.seeds:
                    with console.row(f"{pattern}+{variant}-seed{seed}"):
                        rows.append(self.fine_tuned(pattern, seed, val, variant))
        for label in self.cfg.free_methods:
            with console.row(label):
                rows.append(self.training_free(label, val))
        # reused rows and adapters keep the seconds they took when made: their sum is the cost
        # of the whole table even when this invocation only filled in what changed
        row_seconds = sum(r.get("train_seconds", 0.0) + r["eval_seconds"] + r.get("ruler", {}).get("seconds", 0.0)
                          for r in rows)
        from sparse_ft.bench.machine import describe
        from sparse_ft.experiment.report import write_report

        cost = self.step_cost(options)
        results = {"config": portable(asdict(self.cfg)), "context": self.context, "target": self.target, "rows": rows,
                   "wall_seconds": time.perf_counter() - began, "row_seconds": row_seconds, "machine": describe(),
                   **({"step_cost": cost} if cost is not None else {})}
        write_report(results, self.out)
        return results


def replot(output: Path) -> int:
    """Redraw the plots of a finished experiment from its results.json."""
    from sparse_ft.experiment.report import draw
    from sparse_ft.files.outputs import claim_directory

    if not (output / "results.json").is_file():
        raise FileNotFoundError(f"--output {output} holds no results.json of a finished experiment to redraw")
    claim_directory(output, WRITER, "--output", legacy=lambda found: (found / "rows").is_dir())
    for path in draw(json.loads((output / "results.json").read_text()), output):
        print(f"wrote {path}")
    return 0


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of {kind.__name__}") from None
    return parse


def configure(p: argparse.ArgumentParser) -> None:
    d = ExperimentConfig  # the class's field defaults: an instance would load every method (and torch) to list them
    p.add_argument("--quick", action="store_true", help=f"smaller budget for a first look ({QUICK})")
    p.add_argument("--base", default=d.base, help="the pretrained base checkpoint")
    p.add_argument("--output", default=None, help=f"results folder (default {d.output}, with --quick {QUICK['output']})")
    p.add_argument("--runs", default=None, help=f"adapters (default {d.runs}, with --quick {QUICK['runs']})")
    p.add_argument("--recipe", default=d.recipe, help="the fine-tuning recipe every pattern shares")
    p.add_argument("--rope-method", default=d.rope_method, choices=list(SCALINGS),
                   help="RoPE extension of the fine-tuned rows (default linear = PI); other methods write to "
                        "<output>-<method> and <runs>-<method> unless --output/--runs are given")
    p.add_argument("--patterns", type=_list(str), default=None,
                   help="trained patterns (default: full, then SCCA's Table 2: the patterns tagged scca_table2)")
    variants = "; ".join(f"{name}: {v.why} ({', '.join(v.overrides)})" for name, v in VARIANTS.items())
    p.add_argument("--variants", type=_list(str), default=None,
                   help=f"variant rows of every trained pattern they apply to (default {','.join(VARIANTS)}; none with "
                        f"--quick or --variants ''): {variants}")
    p.add_argument("--seeds", type=_list(int), default=None, help="fine-tuning seeds (default 0,1)")
    p.add_argument("--steps", type=int, default=None, help=f"fine-tuning steps per run (default {d.steps})")
    p.add_argument("--free-methods", type=_list(str), default=None,
                   help="training-free rows (default: every registered training-free method and its ablations)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--replot", action="store_true", help="only redraw the plots of --output from its results.json "
                   "(no training, no evaluation; results.json and tables.md stay as they are)")
    p.set_defaults(func=run)


def config_from_args(args) -> ExperimentConfig:
    cfg = ExperimentConfig(base=args.base, recipe=args.recipe, rope_method=args.rope_method)
    if args.quick:
        cfg = replace(cfg, **QUICK)
    if cfg.rope_method != "linear":  # never overwrite the PI results
        cfg = replace(cfg, output=f"{cfg.output}-{cfg.rope_method}", runs=f"{cfg.runs}-{cfg.rope_method}")
    for key in ("output", "runs", "patterns", "variants", "seeds", "steps", "free_methods"):
        if getattr(args, key) is not None:
            cfg = replace(cfg, **{key: getattr(args, key)})
    return cfg


def run(args) -> int:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    if args.replot:
        return replot(Path(cfg.output))
    results = Runner(cfg).run()
    print((Path(cfg.output) / "tables.md").read_text())
    print(f"wrote {cfg.output} in {results['wall_seconds']:.0f} s")
    return 0
