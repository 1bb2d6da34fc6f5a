"""What a training run owns in ``train.output_dir``, and what it may replace there.

The directory is claimed with ``OUTPUT_MARKER`` (``sparse-ft train``) when a run first writes
it: a new or empty directory, or one an earlier run of sparse-ft wrote. The names in ``WRITTEN``
are the run's own there; any other file in it is the user's and is never touched. Before the
first write a run refuses what it would otherwise lose or write through: a link by one of those
names, a ``checkpoint-N`` that sparse-ft did not write, an earlier run's results that nothing
says to replace. ``train.overwrite_output_dir`` (with ``train.resume=never``) replaces the
earlier run's checkpoints and results, sparse-ft's own, and nothing else.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sparse_ft.config.loader import RESOLVED_RECIPE
from sparse_ft.files.outputs import RUN_LOCK, claim_directory, remove_claimed, written_by
from sparse_ft.train import checkpoint
from sparse_ft.train.metrics import LOG_FILE, TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE
from sparse_ft.train.model_setup import BASE_DIR

ADAPTER = "adapter"
SUMMARY = "train_summary.json"
PROBE = "adapter_probe.safetensors"
RESULTS = (ADAPTER, SUMMARY, PROBE)  # what a finished run leaves
WRITTEN = (*RESULTS, RESOLVED_RECIPE, LOG_FILE, TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE, BASE_DIR, RUN_LOCK)
KEY = "train.output_dir"


def _older_run(directory: Path) -> bool:
    """A run directory written before runs marked theirs: it has a resolved recipe or a checkpoint."""
    return (directory / RESOLVED_RECIPE).is_file() or bool(checkpoint.complete_checkpoints(directory))


def take(output_dir: Path) -> None:
    """Claim ``output_dir`` for this run (before its lock is made in it): new, empty, or an
    earlier run's; a directory of the user's or another command's output is refused."""
    claim_directory(output_dir, checkpoint.WRITER, KEY, legacy=_older_run)


def claim(output_dir: Path, resume: str, overwrite: bool) -> None:
    """Rank 0, holding the lock, before it writes anything: refuse links and foreign
    checkpoints by the run's names, and an earlier run's checkpoints and results unless
    ``resume`` continues them or ``overwrite`` (with ``resume=never``) replaces them, which it
    then does."""
    linked = [output_dir / name for name in WRITTEN if (output_dir / name).is_symlink()]
    linked += [p for p in checkpoint.foreign_checkpoints(output_dir) if p.is_symlink()]
    if linked:
        raise ValueError(f"{KEY}={output_dir}: {linked[0].name} is a symbolic link (to {os.readlink(linked[0])}); "
                         f"a run does not write through links: remove the link, or choose another {KEY}")
    foreign = [p.name for p in checkpoint.foreign_checkpoints(output_dir)]
    adapter = output_dir / ADAPTER
    if adapter.exists() and written_by(adapter) is None and (not adapter.is_dir() or any(adapter.iterdir())):
        foreign.append(ADAPTER)
    if foreign:
        raise ValueError(f"{KEY}={output_dir} holds {', '.join(foreign)}, which sparse-ft did not write: "
                         f"a save would replace it; move it away, or choose another {KEY}")
    ours = [p.name for p in checkpoint.checkpoint_dirs(output_dir)]
    results = [name for name in RESULTS if (output_dir / name).exists()]
    if resume != "never":
        if results and not checkpoint.complete_checkpoints(output_dir):
            raise ValueError(f"{KEY}={output_dir} holds a finished run ({', '.join(results)}) and no checkpoint to resume: "
                             f"choose another {KEY}, or set train.resume=never train.overwrite_output_dir=true to replace it")
        return
    stale = ours + results
    if not stale:
        return
    if not overwrite:
        resume_it = "resume it with train.resume=auto, " if ours else ""
        raise ValueError(f"train.resume=never: {KEY}={output_dir} holds an earlier run's {', '.join(stale)}; "
                         f"{resume_it}choose another {KEY}, or set train.overwrite_output_dir=true to replace them")
    for name in stale:
        path = output_dir / name
        path.unlink() if path.is_symlink() or not path.is_dir() else shutil.rmtree(path)
    print(f"train.overwrite_output_dir: deleted {', '.join(stale)} from {output_dir}", flush=True)


def remove(output_dir: Path) -> None:
    """Remove a run whose result was kept elsewhere (``sparse-ft pretrain`` saves the model
    whole): the names in ``WRITTEN`` and its checkpoints, then the directory once nothing else
    is in it (any other file is the user's, and keeps it)."""
    remove_claimed(output_dir, [*WRITTEN, *(p.name for p in checkpoint.checkpoint_dirs(output_dir))])
