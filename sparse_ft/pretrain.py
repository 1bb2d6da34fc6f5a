"""``sparse-ft pretrain``: the tiny RoPE base model the built-in experiment extends.

A small Llama (8 heads, so every pattern applies) trained from scratch at a short context
on the stdlib + passkey corpus (``data/build_corpus.py``), on a CPU, with plain torch AdamW
and a cosine schedule: nothing here is meant to be a general trainer (that is train.py),
only a reproducible way to re-derive the committed ``assets/tiny-base`` checkpoint.
It finishes by measuring what the experiment relies on: validation perplexity and passkey
retrieval inside the window, both through ``sparse_ft.evaluation``.

torch and numpy load inside the functions that use them, so ``sparse-ft --help`` builds this
command's parser without them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from sparse_ft.config.paths import TINY_BASE_DIR as ASSET_DIR
from sparse_ft.dtypes import NAMES as DTYPES

if TYPE_CHECKING:
    import numpy as np
    import torch

HELP = "pretrain the tiny RoPE base model of the built-in experiment"
CORPUS_DIR = Path("data/corpus/ctx256")


@dataclass
class PretrainConfig:
    """Defaults: the committed checkpoint (~10 minutes on 2 idle CPU cores)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    context: int = 256
    steps: int = 5000
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    save_dtype: str = "float32"
    log_every: int = 10
    eval_windows: int = 200  # validation windows of `context` tokens for the final PPL
    passkey_trials: int = 10  # per needle depth at the full window
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])

    def validate(self) -> None:
        if self.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype={self.save_dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for key in ("steps", "batch_size", "context", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")


def model_config(cfg: PretrainConfig):
    from sparse_ft.tiny import tiny_llama_config

    return tiny_llama_config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                             num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                             num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.context)


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup, then cosine down to ``min_lr_ratio`` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model: torch.nn.Module, cfg: PretrainConfig) -> torch.optim.Optimizer:
    import torch

    # no decay on norms (1-D weights), as usual for transformers
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def train(cfg: PretrainConfig, blocks: np.ndarray, progress: bool = True,
          init_from: Optional[Path] = None) -> tuple[torch.nn.Module, dict]:
    """Train on ``blocks`` (blocks, context) of token ids a fresh model, or continue from the
    checkpoint ``init_from`` (a second phase, e.g. on a passkey-richer corpus); returns (model, stats)."""
    import numpy as np
    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    cfg.validate()
    if blocks.shape[1] != cfg.context:
        raise ValueError(f"the corpus has blocks of {blocks.shape[1]} tokens but context={cfg.context}")
    torch.manual_seed(cfg.seed)
    if init_from is None:
        model = LlamaForCausalLM(model_config(cfg)).train()
    else:
        model = LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32).train()
    opt = _optimizer(model, cfg)
    order = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(blocks), generator=order)
    cursor, epochs = 0, 0
    curve, window = [], []
    began = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="pretrain", unit="step", disable=not progress)
    for step in bar:
        if cursor + cfg.batch_size > len(perm):
            perm, cursor, epochs = torch.randperm(len(blocks), generator=order), 0, epochs + 1
        index = np.sort(perm[cursor : cursor + cfg.batch_size].numpy())
        cursor += cfg.batch_size
        ids = torch.from_numpy(np.asarray(blocks[index], dtype=np.int64))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            curve.append({"step": step + 1, "loss": sum(window) / len(window), "lr": lr_at(step, cfg)})
            bar.set_postfix(loss=f"{curve[-1]['loss']:.3f}")
            window = []
    seconds = time.perf_counter() - began
    stats = {"steps": cfg.steps, "tokens": cfg.steps * cfg.batch_size * cfg.context, "epochs_completed": epochs,
             "corpus_blocks": int(len(blocks)), "final_loss": curve[-1]["loss"], "train_seconds": seconds,
             "tokens_per_second": cfg.steps * cfg.batch_size * cfg.context / seconds, "loss_curve": curve,
             "parameters": sum(p.numel() for p in model.parameters())}
    return model.eval(), stats


def evaluate(model, tokenizer, val_tokens: np.ndarray, cfg: PretrainConfig) -> dict:
    """Validation PPL at the training context and passkey accuracy at the full window, through
    the project's evaluator so the numbers match ``sparse-ft eval``."""
    from sparse_ft import methods
    from sparse_ft.evaluation import passkey, ppl

    full = methods.get("full")
    result = ppl.evaluate_length(model, val_tokens, cfg.context, cfg.context, "standard", full, batch_size=8,
                                 max_windows=cfg.eval_windows)
    out = {"val_ppl": result["ppl"], "val_tokens_scored": result["tokens"]}
    if cfg.passkey_trials:
        # at `context` the answer is decoded just past the window; at `context - 8` it lies inside
        lengths = [cfg.context - 8, cfg.context]
        cells = passkey.evaluate(model, tokenizer, lengths, cfg.passkey_depths, cfg.passkey_trials, full, seed=cfg.seed)
        out["passkey"] = cells
        out["passkey_accuracy"] = {n: sum(c["accuracy"] for c in cells if c["length"] == n) / len(cfg.passkey_depths)
                                   for n in lengths}
    return out


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__}


def save(model, tokenizer, stats: dict, output: Path, save_dtype: str, overwrite: bool = False) -> Path:
    """Written to a temporary directory and renamed: an interrupted save leaves the old one."""
    from sparse_ft.dtypes import torch_dtype
    from sparse_ft.models import atomic_directory

    with atomic_directory(Path(output), "sparse-ft pretrain", overwrite, "--output") as tmp:
        model.to(torch_dtype(save_dtype)).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "pretrain_stats.json").write_text(json.dumps(stats, indent=1))
    return output


def pretrain(cfg: PretrainConfig, corpus: Path = CORPUS_DIR, output: Path = ASSET_DIR, progress: bool = True,
             init_from: Optional[Path] = None, passkey_fraction: Optional[float] = None, max_blocks: Optional[int] = None,
             overwrite: bool = False) -> dict:
    """Build the corpus if missing, train, evaluate, save; returns the stats written (with the
    stats of ``init_from``'s training under ``previous_phase``). ``output`` is checked first:
    apart from the inputs, and an earlier output of this command only with ``overwrite``."""
    from sparse_ft.data.corpus import PASSKEY_FRACTION, build_corpus, load_blocks
    from sparse_ft.evaluation.tokens import load_tokens
    from sparse_ft.models import check_apart, check_output_dir
    from sparse_ft.tiny import tiny_tokenizer

    corpus, output = Path(corpus), Path(output)
    check_apart(output, "--output", {"--corpus": corpus, "--init-from": init_from})
    check_output_dir(output, overwrite)
    tokenizer = tiny_tokenizer()
    if not (corpus / "corpus.json").exists():
        print(f"building the corpus in {corpus} (data/build_corpus.py)")
        build_corpus(corpus, tokenizer, context=cfg.context, seed=cfg.seed, max_blocks=max_blocks,
                     passkey_fraction=PASSKEY_FRACTION if passkey_fraction is None else passkey_fraction)
    previous = None
    if init_from is not None:
        stats_file = Path(init_from) / "pretrain_stats.json"
        previous = json.loads(stats_file.read_text()) if stats_file.is_file() else {"checkpoint": str(init_from)}
    began = time.perf_counter()
    model, stats = train(cfg, load_blocks(corpus), progress, init_from)
    if previous is not None:
        stats["previous_phase"] = previous
    val = load_tokens(str(corpus / "val.bin"), tokenizer, model.config.vocab_size)
    stats["evaluation"] = evaluate(model, tokenizer, val, cfg)
    stats.update(config=asdict(cfg), corpus=json.loads((corpus / "corpus.json").read_text()), machine=machine(),
                 wall_seconds=time.perf_counter() - began, saved_dtype=cfg.save_dtype)
    save(model, tokenizer, stats, output, cfg.save_dtype, overwrite)
    return stats


FLAGS = {  # PretrainConfig fields the command line sets, with their help
    "hidden_size": "model width", "intermediate_size": "MLP width", "num_hidden_layers": "layers",
    "num_attention_heads": "query heads", "num_key_value_heads": "key/value heads", "context": "training context in tokens",
    "steps": "optimizer steps", "batch_size": "blocks per step", "warmup_steps": "linear warmup steps",
    "seed": "seed of the model, data order and passkeys", "passkey_trials": "passkey keys per depth in the final check",
    "eval_windows": "validation windows of the final PPL", "lr": "peak learning rate",
}


def configure(p: argparse.ArgumentParser) -> None:
    defaults = PretrainConfig()
    p.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="token corpus, built here by data/build_corpus.py if missing")
    p.add_argument("--output", type=Path, default=ASSET_DIR,
                   help="checkpoint directory; new, empty, or an earlier output with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace --output when it holds an earlier sparse-ft output")
    for key, text in FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(getattr(defaults, key)), default=getattr(defaults, key), help=text)
    p.add_argument("--save-dtype", default=defaults.save_dtype, choices=DTYPES, help="dtype of the saved weights")
    p.add_argument("--init-from", type=Path, default=None, help="continue from this checkpoint, a second phase (default: a fresh model)")
    p.add_argument("--passkey-fraction", type=float, default=None,
                   help="share of passkey documents when the corpus is built here (default: data/build_corpus.py's)")
    p.add_argument("--max-blocks", type=int, default=None, help="when the corpus is built here: stop after N blocks (default: no limit)")
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
    stats = pretrain(cfg, args.corpus, args.output, init_from=args.init_from, passkey_fraction=args.passkey_fraction,
                     max_blocks=args.max_blocks, overwrite=args.overwrite)
    ev = stats["evaluation"]
    print(f"{stats['tokens']} tokens, {stats['steps']} steps in {stats['train_seconds']:.0f} s; final loss "
          f"{stats['final_loss']:.3f}; val PPL@{cfg.context} {ev['val_ppl']:.3f}; passkey accuracy "
          + ", ".join(f"@{n}: {acc:.2f}" for n, acc in ev.get("passkey_accuracy", {}).items()))
    print(f"wrote {args.output}")
    return 0
