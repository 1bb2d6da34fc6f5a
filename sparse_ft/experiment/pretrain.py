"""``sparse-ft pretrain``: the tiny RoPE base model the built-in experiment extends.

A small Llama (8 heads, so every pattern applies) trained from scratch at a short context
on the stdlib + passkey corpus (``scripts/build_corpus.py``), on a CPU. The training is the
toolkit's one trainer (``sparse_ft.train.pretrainer``: the fine-tuning loop, optimizer and
schedule, every weight trainable); this module maps its settings onto a recipe, then measures
what the experiment relies on, validation perplexity and passkey retrieval inside the window,
both through ``sparse_ft.evaluation``, and saves the checkpoint (``assets/tiny-base``).
The trainer's run directory (``OUTPUT.run`` unless ``--run-dir`` names one) keeps a checkpoint
every ``--save-minutes`` and one on SIGTERM or SIGINT, so a killed or stopped pretraining resumes
where it was when the same command is run again; it is removed once the model is saved.

torch and numpy load inside the functions that use them, so ``sparse-ft --help`` builds this
command's parser without them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from sparse_ft.config.paths import TINY_BASE_DIR as ASSET_DIR
from sparse_ft.modeling import dtypes
from sparse_ft.modeling.tiny import BUILT_IN

if TYPE_CHECKING:
    import numpy as np
    import torch

    from sparse_ft.config import Recipe, TrainSection

HELP = "pretrain the tiny RoPE base model of the built-in experiment"
CORPUS_DIR = Path("data/corpus/ctx256")
STATS_FILE = "pretrain_stats.json"
WRITER = "sparse-ft pretrain"  # the command named by the markers of its outputs and run directories
TRAINING = "train"  # in the run directory: the trainer's output directory (its checkpoints)
REBASED = "rebased-base"  # in the run directory: the checkpoint a phase continues, at its new RoPE base
REBASED_FROM = "rebased_from.json"  # in it: which checkpoint, at which base


@dataclass
class PretrainConfig:
    """Defaults: the settings of the committed checkpoint (10 minutes on 2 idle CPU cores)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    context: int = 256
    max_positions: int = 0  # the fresh model's position window (0: context); a first phase sets the second's C
    rope_theta: float = 0.0  # RoPE's base (0: the tiny model's, or the checkpoint's); with init_from, it continues at this one
    steps: int = 5000
    batch_size: int = 8
    lr: float = 3e-3
    scheduler: str = "cosine"  # constant: no decay, the phase that forms copy heads (docs/experiment.md)
    min_lr_ratio: float = 0.1  # cosine's floor, as a share of lr
    warmup_steps: int = 50  # steps up to the peak lr, the peak's own included
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1  # seed 0 through the trainer never learned to retrieve (docs/experiment.md)
    save_dtype: str = "float32"
    log_every: int = 10
    eval_windows: int = 200  # validation windows of `context` tokens for the final PPL
    passkey_trials: int = 10  # per needle depth at the full window
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    tokenizer: str = "byte"  # byte: the committed base's; bpe: assets/tiny-bpe (RULER's prompts fit 1,024 tokens)
    save_minutes: float = 10.0  # a checkpoint in the run directory this often: what a killed run resumes from
    retrieval_tasks: list[str] = field(default_factory=lambda: ["passkey"])  # the corpus's retrieval documents

    def validate(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer={self.tokenizer!r} is unknown; allowed: {', '.join(TOKENIZERS)}")
        if not self.retrieval_tasks:
            raise ValueError("retrieval_tasks is empty; name passkey and/or RULER tasks (all: every one)")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is unknown; allowed: {', '.join(SCHEDULERS)}")
        if self.save_dtype not in dtypes.NAMES:
            raise ValueError(f"save_dtype={self.save_dtype!r} is unknown; allowed: {', '.join(dtypes.NAMES)}")
        for key in ("steps", "batch_size", "context", "log_every", "eval_windows", "num_attention_heads",
                    "num_key_value_heads", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.rope_theta and not self.rope_theta > 1:
            raise ValueError(f"rope_theta={self.rope_theta} must be 0 (keep the model's) or > 1")
        if self.max_positions and self.max_positions < self.context:
            raise ValueError(f"max_positions={self.max_positions} must be 0 (the context) or >= context={self.context}")
        if self.passkey_trials < 0:
            raise ValueError(f"passkey_trials={self.passkey_trials} must be >= 0")
        if self.save_minutes < 0:
            raise ValueError(f"save_minutes={self.save_minutes} must be > 0 (minutes between checkpoints), or 0 for none "
                             "before the last step")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")


TOKENIZERS = ("byte", "bpe")
SCHEDULERS = ("constant", "cosine")  # the trainer's (config.schema.CHOICES["train.scheduler"]) that pretraining uses


def tokenizer_for(cfg: PretrainConfig):
    """The tokenizer ``cfg`` names: the byte tokenizer or the committed BPE (``assets/tiny-bpe``)."""
    if cfg.tokenizer == "bpe":
        from sparse_ft.experiment.tokenizer import TOKENIZER_DIR
        from sparse_ft.modeling.model_io import load_tokenizer

        return load_tokenizer(str(TOKENIZER_DIR))
    from sparse_ft.modeling.tiny import tiny_tokenizer

    return tiny_tokenizer()


def retrieval_kinds(names: list[str]) -> list[str]:
    """``names`` with ``all`` expanded to passkey and every registered RULER task (the
    training-only documents are asked for by name)."""
    from sparse_ft.evaluation.tasks.generation import registered_ruler_tasks
    from sparse_ft.experiment.retrieval_docs import TRAINING_ONLY

    every = ["passkey", *registered_ruler_tasks()]
    unknown = [n for n in names if n not in every and n != "all" and n not in TRAINING_ONLY]
    if unknown:
        raise ValueError(f"retrieval_tasks: {', '.join(map(repr, unknown))} unknown; allowed: {', '.join(every + list(TRAINING_ONLY))} "
                         "or all")
    return list(dict.fromkeys(k for n in names for k in (every if n == "all" else [n])))


def train_section(cfg: PretrainConfig, output_dir: Path) -> TrainSection:
    """``cfg``'s optimizer, schedule and budget as a recipe's ``train``: AdamW with decay on
    the matrices only, constant or cosine to ``min_lr_ratio``. ``cfg.warmup_steps`` counts the step that
    reaches the peak; the recipe's ``train.warmup_steps`` counts the steps before it."""
    from sparse_ft.config import TrainSection

    return TrainSection(
        output_dir=str(output_dir), max_steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay, weight_decay_on="matrices",
        betas=[0.9, 0.95], warmup_steps=max(0, cfg.warmup_steps - 1), scheduler=cfg.scheduler,
        min_lr_ratio=cfg.min_lr_ratio if cfg.scheduler == "cosine" else 0.0,
        per_device_batch_size=cfg.batch_size, gradient_accumulation_steps=1, gradient_checkpointing=False,
        max_grad_norm=cfg.grad_clip, seed=cfg.seed, save_steps=cfg.steps, save_minutes=cfg.save_minutes, save_total_limit=1,
        log_steps=cfg.log_every, resume="auto", report_to=["none"])


def recipe_for(cfg: PretrainConfig, output_dir: Path, init_from: Optional[Path] = None, source: str = "") -> Recipe:
    """The recipe the trainer runs for ``cfg``, checked like a loaded one: the tiny model with
    ``cfg``'s dimensions fresh from ``cfg.seed`` (or the checkpoint ``init_from``), at
    ``cfg.context``, with the model's own attention, in float32, without DeepSpeed. A checkpoint
    whose window is shorter than ``cfg.context`` is extended by PI; a first phase that sets
    ``max_positions`` to the second's context leaves plain RoPE to train there. ``source``
    names the corpus the blocks came from (the trainer is handed the blocks themselves)."""
    from sparse_ft.config import AttentionSection, DataSection, ModelSection, Recipe
    from sparse_ft.config.schema import validate

    dims = {key: getattr(cfg, key) for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads")}
    if cfg.tokenizer != "byte":  # the byte tokenizer's ids are the tiny model's own vocabulary
        dims["vocab_size"] = len(tokenizer_for(cfg))
    dims["max_position_embeddings"] = cfg.max_positions or cfg.context
    if cfg.rope_theta:
        dims["rope_theta"] = cfg.rope_theta
    model = (ModelSection(name_or_path=BUILT_IN, tiny=dims, dtype="float32", target_length=cfg.context) if init_from is None else
             ModelSection(name_or_path=str(init_from), dtype="float32", target_length=cfg.context))
    recipe = Recipe(model=model, attention=AttentionSection(pattern="full"), data=DataSection(source=source),
                    train=train_section(cfg, output_dir), deepspeed=None, name="pretrain")
    validate(recipe)
    return recipe


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """The learning rate of ``step``: the trainer's schedule with ``cfg``'s settings."""
    from sparse_ft.train.engine import schedule

    return cfg.lr * schedule(train_section(cfg, Path(".")), cfg.steps)(step)


def loss_curve(history: list[dict], every: int) -> list[dict]:
    """The mean loss of every ``every`` steps (the last run may be shorter), with the lr of its
    last step: the trainer's per-step history as the stats record it."""
    windows = (history[i : i + every] for i in range(0, len(history), every))
    return [{"step": w[-1]["step"], "loss": sum(r["loss"] for r in w) / len(w), "lr": w[-1]["lr"]} for w in windows]


def train(cfg: PretrainConfig, blocks: np.ndarray, progress: bool = True, init_from: Optional[Path] = None,
          *, source: str = "", run_dir: Optional[Path] = None) -> tuple[torch.nn.Module, dict]:
    """Train on ``blocks`` (blocks, context) of token ids, read from ``source``, a fresh model,
    or continue from the checkpoint ``init_from`` (a second phase, e.g. on a passkey-richer
    corpus); returns (model, stats). The trainer's run (resolved recipe, log, checkpoints) goes
    to ``run_dir`` (its ``TRAINING`` directory), where a run killed or stopped by a signal
    resumes from its last checkpoint (the caller removes it once the model is saved,
    :func:`remove_run`), or, without one, to a temporary directory."""
    import contextlib

    from sparse_ft.files.outputs import claim_directory
    from sparse_ft.train.pretrainer import Pretrainer

    cfg.validate()
    if blocks.shape[1] != cfg.context:
        raise ValueError(f"the corpus has blocks of {blocks.shape[1]} tokens but context={cfg.context}")
    began = time.perf_counter()
    with contextlib.ExitStack() as temporary:
        kept = run_dir is not None
        run_dir = Path(run_dir) if kept else Path(temporary.enter_context(tempfile.TemporaryDirectory(prefix="sparse-ft-pretrain-")))
        claim_directory(run_dir, WRITER, "--run-dir")
        if init_from is not None and cfg.rope_theta:
            init_from = rebased(Path(init_from), cfg.rope_theta, run_dir / REBASED)
        trainer = Pretrainer(recipe_for(cfg, run_dir / TRAINING, init_from, source), blocks, progress, stops_on_signals=kept)
        try:
            history = trainer.run()["history"]
        except ValueError as err:
            if kept and str(err).startswith("train.resume"):  # the trainer's words for what pretrain calls --run-dir
                raise ValueError(f"{err} (train.output_dir is {run_dir / TRAINING}: name another --run-dir, or remove "
                                 f"{run_dir} to start afresh)") from err
            raise
    seconds = time.perf_counter() - began
    curve = loss_curve(history, cfg.log_every)
    tokens = cfg.steps * cfg.batch_size * cfg.context
    stats = {"steps": cfg.steps, "tokens": tokens, "epochs_completed": cfg.steps // trainer.order.per_epoch,
             "corpus_blocks": int(len(blocks)), "final_loss": curve[-1]["loss"], "train_seconds": seconds,
             "tokens_per_second": (cfg.steps - trainer.start) * cfg.batch_size * cfg.context / seconds, "loss_curve": curve,
             "parameters": sum(p.numel() for p in trainer.model.parameters()),
             "resumed_from_step": trainer.start}  # train_seconds and tokens_per_second: the steps after it
    return trainer.model.eval(), stats


def remove_run(run_dir: Path) -> None:
    """The run directory of a pretraining whose model is saved: nothing in it is left to resume."""
    from sparse_ft.files.outputs import remove_claimed
    from sparse_ft.train import run_directory

    if (run_dir / TRAINING).is_dir():
        run_directory.remove(run_dir / TRAINING)
    remove_claimed(run_dir, [REBASED])


def rebased(checkpoint: Path, theta: float, into: Path) -> Path:
    """``checkpoint`` to continue at RoPE base ``theta``: itself when its base is ``theta``, else
    a copy at ``into`` whose config says ``theta`` (the weights are the checkpoint's, and
    adapt to the new base as the phase trains), written once: a resumed run finds it there, and
    a run directory left by a phase of another checkpoint or base is refused. Why a later phase
    raises it: with 16 dimensions per head at the default 10,000, only two of the eight
    frequency pairs turn by less than a radian over 1,000 tokens, and the two-phase BPE bases
    found a needle reliably only ~500 tokens back; a third phase at 500,000 found it at every
    depth of 1,016 (docs/experiment.md)."""
    import shutil

    from transformers import AutoConfig

    from sparse_ft.files.outputs import atomic_directory
    from sparse_ft.modeling import rope

    config = AutoConfig.from_pretrained(checkpoint)
    params = rope.rope_parameters(config)
    if params["rope_type"] != "default":
        raise ValueError(f"--rope-theta with --init-from needs a checkpoint with plain RoPE; {checkpoint} has "
                         f"rope_type {params['rope_type']!r}")
    if params["rope_theta"] == theta:
        return checkpoint
    source = {"checkpoint": str(checkpoint.resolve()), "rope_theta": theta}
    if into.is_dir():
        found = json.loads((into / REBASED_FROM).read_text()) if (into / REBASED_FROM).is_file() else None
        if found != source:
            raise ValueError(f"--run-dir {into.parent} holds a run that continued {found or 'an unknown checkpoint'}; this "
                             f"one continues {source}: name another --run-dir, or remove it to start afresh")
        return into
    with atomic_directory(into, WRITER, False, "--run-dir") as tmp:
        shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
        rope.restore(config, rope.portable({**params, "rope_theta": theta}), config.max_position_embeddings)
        config.save_pretrained(tmp)
        (tmp / REBASED_FROM).write_text(json.dumps(source))
    return into


def evaluate(model, tokenizer, val_tokens: np.ndarray, cfg: PretrainConfig) -> dict:
    """Validation PPL at the training context and passkey accuracy at the full window, through
    the project's evaluator so the numbers match ``sparse-ft eval``."""
    from sparse_ft import methods
    from sparse_ft.evaluation import window_perplexity
    from sparse_ft.evaluation.tasks.passkey import Passkey

    full = methods.get("full")
    result = window_perplexity.evaluate_length(model, val_tokens, cfg.context, cfg.context, scoring="standard",
                                               method=full, batch_size=8, max_windows=cfg.eval_windows)
    out = {"val_ppl": result["ppl"], "val_tokens_scored": result["tokens"],
           "copy": copy_losses(model, val_tokens, cfg.context, seed=cfg.seed)}
    if cfg.passkey_trials:
        # at `context` the answer is decoded just past the window; at `context - 8` it lies inside
        lengths = [cfg.context - 8, cfg.context]
        cells = Passkey(lengths, cfg.passkey_depths, trials=cfg.passkey_trials, seed=cfg.seed).evaluate(
            model, tokenizer, full)
        out["passkey"] = cells
        out["passkey_accuracy"] = {n: sum(c["accuracy"] for c in cells if c["length"] == n) / len(cfg.passkey_depths)
                                   for n in lengths}
    return out


def copy_losses(model, tokens: np.ndarray, context: int, *, seed: int, rows: int = 8) -> list[dict]:
    """Whether the model has copy (induction) heads, the mechanism every retrieval task needs:
    its mean loss (nats) on the first copy of a span of random ids (drawn from those of
    ``tokens``, the validation text) and on the copies that repeat it to ``context`` tokens, per
    span length. Without copy heads the two are equal (a base that retrieves nothing, docs/
    experiment.md); with them the later copies cost a small fraction of the first."""
    import numpy as np
    import torch

    ids = torch.from_numpy(np.unique(np.asarray(tokens)).astype(np.int64))
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for span in sorted({min(s, context // 2) for s in (8, 32, 128)}):
        spans = ids[torch.randint(len(ids), (rows, span), generator=gen)]
        x = spans.repeat(1, -(-context // span))[:, :context].to(device)
        with torch.no_grad():
            nll = torch.nn.functional.cross_entropy(model(x).logits[:, :-1].transpose(1, 2).float(), x[:, 1:], reduction="none")
        out.append({"span": span, "first": nll[:, : span - 1].mean().item(), "later": nll[:, span - 1 :].mean().item()})
    return out


def save(model, tokenizer, stats: dict, output: Path, *, save_dtype: str, overwrite: bool = False) -> Path:
    """Written to a temporary directory and renamed: an interrupted save leaves the old one."""
    from sparse_ft.modeling.dtypes import torch_dtype
    from sparse_ft.files.outputs import atomic_directory

    with atomic_directory(Path(output), WRITER, overwrite, "--output") as tmp:
        model.to(torch_dtype(save_dtype)).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / STATS_FILE).write_text(json.dumps(stats, indent=1))
    return output


def pretrain(cfg: PretrainConfig, corpus: Path = CORPUS_DIR, output: Path = ASSET_DIR, progress: bool = True,
             *, init_from: Optional[Path] = None, retrieval_fraction: Optional[float] = None,
             max_blocks: Optional[int] = None, text_passes: int = 1, copy_fraction: float = 0.0,
             full_fraction: float = 0.0, lookup_fraction: float = 0.0, copy_pieces: float = 0.0,
             copy_names: Optional[float] = None, keys: str = "frequent", overwrite: bool = False,
             run_dir: Optional[Path] = None) -> dict:
    """Build the corpus if missing, train, evaluate, save; returns the stats written (with the
    stats of ``init_from``'s training under ``previous_phase``). ``output`` is checked first:
    apart from the inputs, and an earlier output of this command only with ``overwrite``. The
    training runs in ``run_dir`` (default ``OUTPUT.run``), resuming a run killed there, and
    that directory is removed once the model is saved."""
    from sparse_ft.experiment.corpus import RETRIEVAL_FRACTION, build_corpus, fits_one, load_blocks
    from sparse_ft.experiment.retrieval_docs import COPY_NAMES, KEY_RANKS
    from sparse_ft.evaluation.tokens import load_tokens
    from sparse_ft.files.outputs import check_apart, check_claimable, check_output_dir

    corpus, output = Path(corpus), Path(output)
    cfg.validate()  # before the corpus is built: a bad setting costs seconds, not minutes
    kinds = retrieval_kinds(cfg.retrieval_tasks)
    if corpus.exists() and not corpus.is_dir():
        raise ValueError(f"--corpus {corpus} is a file; a corpus is a directory (scripts/build_corpus.py writes one)")
    retrieval_fraction = RETRIEVAL_FRACTION if retrieval_fraction is None else retrieval_fraction
    if not 0 <= retrieval_fraction <= 1:
        raise ValueError(f"--retrieval-fraction {retrieval_fraction} must be within [0, 1]")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"--max-blocks {max_blocks} must be >= 1")
    if text_passes < 1:
        raise ValueError(f"--text-passes {text_passes} must be >= 1")
    if not (0 <= lookup_fraction and fits_one(retrieval_fraction, lookup_fraction)):
        raise ValueError(f"--lookup-fraction {lookup_fraction} must be within [0, 1 - --retrieval-fraction]")
    if not (0 <= copy_fraction and fits_one(retrieval_fraction, lookup_fraction, copy_fraction)):
        raise ValueError(f"--copy-fraction {copy_fraction} must be within [0, 1 - --retrieval-fraction"
                         + (" - --lookup-fraction]" if lookup_fraction else "]"))
    if not 0 <= full_fraction <= 1:
        raise ValueError(f"--full-fraction {full_fraction} must be within [0, 1]")
    if not 0 <= copy_pieces <= 1:
        raise ValueError(f"--copy-pieces {copy_pieces} must be within [0, 1]")
    if copy_names is not None and not 0 <= copy_names <= 1:
        raise ValueError(f"--copy-names {copy_names} must be within [0, 1]")
    if copy_names is not None and not copy_pieces:
        raise ValueError(f"--copy-names {copy_names} is a share of the piece spans' items; --copy-pieces 0 draws none "
                         "(set --copy-pieces above 0)")
    if copy_pieces and not copy_fraction:
        raise ValueError(f"--copy-pieces {copy_pieces} is a share of the copy documents; --copy-fraction 0 draws none "
                         "(set --copy-fraction above 0)")
    if init_from is not None and cfg.max_positions:
        raise ValueError(f"--max-positions {cfg.max_positions} sets a fresh model's window; with --init-from the "
                         "checkpoint's own is kept (omit one of them)")
    if keys not in KEY_RANKS:
        raise ValueError(f"--keys {keys}: one of {', '.join(KEY_RANKS)}")
    copy_names = COPY_NAMES if copy_names is None else copy_names
    run_dir = output.with_name(output.name + ".run") if run_dir is None else Path(run_dir)
    inputs = {"--corpus": corpus, "--init-from": init_from and Path(init_from)}
    check_apart(output, "--output", {**inputs, "--run-dir": run_dir})
    check_apart(run_dir, "--run-dir", {**inputs, "--output": output})
    check_output_dir(output, overwrite)
    check_claimable(run_dir, WRITER, "--run-dir")  # before the corpus is built; train() claims it
    build = not (corpus / "corpus.json").exists()
    if build:  # into a new or empty directory: its files have fixed names
        check_apart(corpus, "--corpus", {"--init-from": init_from and Path(init_from)})
        check_output_dir(corpus, False, "--corpus")
    tokenizer = tokenizer_for(cfg)
    if build:
        print(f"building the corpus in {corpus} (scripts/build_corpus.py)")
        build_corpus(corpus, tokenizer, context=cfg.context, seed=cfg.seed, max_blocks=max_blocks,
                     retrieval_fraction=retrieval_fraction,
                     retrieval_tasks=kinds, text_passes=text_passes, copy_fraction=copy_fraction,
                     full_fraction=full_fraction, lookup_fraction=lookup_fraction, copy_pieces=copy_pieces,
                     copy_names=copy_names, keys=keys)
    else:  # a corpus built for other settings would train, silently, on other tokens
        try:
            built = dict(json.loads((corpus / "corpus.json").read_text()))
        except (ValueError, TypeError):  # not a manifest: load_blocks says so, naming the file
            built = {}
        want = {"tokenizer": type(tokenizer).__name__, "retrieval_tasks": kinds, "copy_fraction": copy_fraction,
                "full_fraction": full_fraction, "lookup_fraction": lookup_fraction, "copy_pieces": copy_pieces,
                "copy_names": copy_names, "keys": keys}
        before = {"tokenizer": "ByT5Tokenizer", "retrieval_tasks": ["passkey"], "copy_fraction": 0.0,
                  "full_fraction": 0.0, "lookup_fraction": 0.0, "copy_pieces": 0.0,
                  "copy_names": COPY_NAMES, "keys": "frequent"}  # corpora built before these keys
        wrong = {k: built.get(k, before[k]) for k in want if built.get(k, before[k]) != want[k]}
        if wrong:
            raise ValueError(f"--corpus {corpus} was built with {wrong}, these settings need "
                             f"{ {k: want[k] for k in wrong} }; name a new --corpus directory")
    previous = None
    if init_from is not None:
        stats_file = Path(init_from) / STATS_FILE
        previous = json.loads(stats_file.read_text()) if stats_file.is_file() else {"checkpoint": str(init_from)}
    began = time.perf_counter()
    model, stats = train(cfg, load_blocks(corpus), progress, init_from, source=str(corpus / "train.bin"), run_dir=run_dir)
    if previous is not None:
        stats["previous_phase"] = previous
    val = load_tokens(str(corpus / "val.bin"), tokenizer, model.config.vocab_size)
    stats["evaluation"] = evaluate(model, tokenizer, val, cfg)
    from sparse_ft.bench.machine import describe

    stats.update(config=asdict(cfg), corpus=json.loads((corpus / "corpus.json").read_text()), machine=describe(),
                 wall_seconds=time.perf_counter() - began, saved_dtype=cfg.save_dtype)
    save(model, tokenizer, stats, output, save_dtype=cfg.save_dtype, overwrite=overwrite)
    remove_run(run_dir)
    return stats


FLAGS = {  # PretrainConfig fields the command line sets, with their help
    "hidden_size": "model width", "intermediate_size": "MLP width", "num_hidden_layers": "layers",
    "num_attention_heads": "query heads", "num_key_value_heads": "key/value heads", "context": "training context in tokens",
    "max_positions": "a fresh model's position window, for a later phase at a longer context without RoPE scaling (0: the context)",
    "rope_theta": "RoPE's base; with --init-from the checkpoint continues at it (0: the model's own)",
    "steps": "optimizer steps", "batch_size": "blocks per step", "warmup_steps": "linear warmup steps",
    "seed": "seed of the model, data order and passkeys", "passkey_trials": "passkey keys per depth in the final check",
    "eval_windows": "validation windows of the final PPL", "lr": "peak learning rate",
    "save_minutes": "minutes between the checkpoints a killed run resumes from (0: none before the last step)",
}


def configure(p: argparse.ArgumentParser) -> None:
    defaults = PretrainConfig()
    p.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="token corpus, built here by scripts/build_corpus.py if missing")
    p.add_argument("--output", type=Path, default=ASSET_DIR,
                   help="checkpoint directory; new, empty, or an earlier output with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace --output when it holds an earlier sparse-ft output")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the training run's checkpoints (default: OUTPUT.run); run the same command again to resume a "
                        "killed or stopped run from there; removed once --output is saved")
    for key, text in FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(getattr(defaults, key)), default=getattr(defaults, key), help=text)
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=defaults.tokenizer,
                   help="byte (the committed base's) or bpe (assets/tiny-bpe: RULER's prompts fit a 1,024-token context)")
    p.add_argument("--retrieval-tasks", type=lambda s: [t for t in s.split(",") if t], default=defaults.retrieval_tasks,
                   help="the kinds of retrieval document the corpus mixes in, when built here: passkey and/or RULER task "
                        "names, comma-separated, or all (passkey and every RULER task); and by name, training only, "
                        "vt_drills (several variable-tracking chains, each asked and answered), cwe_drills (several "
                        "common-words lists, each asked and answered) and cwe_pseudo_drills (the same of made-up words) "
                        "(default: passkey)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default=defaults.scheduler,
                   help=f"lr after warmup: constant, or cosine to {defaults.min_lr_ratio:g} of --lr (default: {defaults.scheduler})")
    p.add_argument("--save-dtype", default=defaults.save_dtype, choices=dtypes.NAMES, help="dtype of the saved weights")
    p.add_argument("--init-from", type=Path, default=None, help="continue from this checkpoint, a second phase (default: a fresh model)")
    p.add_argument("--retrieval-fraction", type=float, default=None,
                   help="share of blocks that open with a retrieval document (--retrieval-tasks), when the corpus is "
                        "built here (default: scripts/build_corpus.py's)")
    p.add_argument("--max-blocks", type=int, default=None, help="when the corpus is built here: stop after N blocks (default: no limit)")
    p.add_argument("--text-passes", type=int, default=1,
                   help="when the corpus is built here: lay its text out N times, each with fresh retrieval documents")
    p.add_argument("--copy-fraction", type=float, default=0.0,
                   help="when the corpus is built here: share of blocks that open with a copy document (text, then "
                        "a span of words repeated to its end: the dense signal that forms copy heads); default 0")
    p.add_argument("--copy-pieces", type=float, default=0.0,
                   help="when the corpus is built here: share of the copy documents whose span is ids drawn from every "
                        "id of the training text and names of capital letters, instead of words and numbers (copying "
                        "made generic: copy heads formed on words copy no word unseen in training); default 0")
    p.add_argument("--copy-names", type=float, default=None,
                   help="when the corpus is built here: share of a piece span's items that are capital-letter names, the "
                        "rest ids (0: ids alone, which makes copying generic fastest); default: half")
    p.add_argument("--keys", choices=("frequent", "rare"), default="frequent",
                   help="when the corpus is built here: the needles' keys, pairs of the standard library's frequent "
                        "words, or of rare ones that split into as many BPE pieces as the evaluation's keys; default "
                        "frequent")
    p.add_argument("--lookup-fraction", type=float, default=0.0,
                   help="when the corpus is built here: share of blocks that open with a lookup document (needles, "
                        "one key asked, then every key and keys at random drilled, each answered: the signal for matching a key); "
                        "default 0")
    p.add_argument("--full-fraction", type=float, default=0.0,
                   help="when the corpus is built here: share of retrieval, lookup and copy documents that fill their block "
                        "(needles a whole context before their question, which uniform lengths rarely draw); default 0")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is much faster when other jobs share the cores)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    keys = PretrainConfig.__dataclass_fields__
    cfg = PretrainConfig(**{k: v for k, v in vars(args).items() if k in keys})
    stats = pretrain(cfg, args.corpus, args.output, init_from=args.init_from, retrieval_fraction=args.retrieval_fraction,
                     max_blocks=args.max_blocks, text_passes=args.text_passes, copy_fraction=args.copy_fraction,
                     full_fraction=args.full_fraction, lookup_fraction=args.lookup_fraction, copy_pieces=args.copy_pieces,
                     copy_names=args.copy_names, keys=args.keys, overwrite=args.overwrite, run_dir=args.run_dir)
    ev = stats["evaluation"]
    print(f"{stats['tokens']} tokens, {stats['steps']} steps in {stats['train_seconds']:.0f} s; final loss "
          f"{stats['final_loss']:.3f}; val PPL@{cfg.context} {ev['val_ppl']:.3f}; passkey accuracy "
          + ", ".join(f"@{n}: {acc:.2f}" for n, acc in ev.get("passkey_accuracy", {}).items()))
    print("loss on repeated random spans, first copy -> later copies (equal: no copy heads): "
          + ", ".join(f"span {c['span']}: {c['first']:.2f} -> {c['later']:.2f}" for c in ev["copy"]))
    print(f"wrote {args.output}")
    return 0
