"""Resumable checkpoints in safetensors + JSON, never pickle.

A checkpoint is written into ``checkpoint-N.tmp``; only after every rank has written its part
does rank 0 write ``meta.json`` and rename the directory to ``checkpoint-N``. A crash at any
moment leaves either a complete ``checkpoint-N`` or a ``.tmp`` directory that resume ignores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from sparse_ft.train.engine import Engine

STATE_KEYS = ("exp_avg", "exp_avg_sq")
_NAME = re.compile(r"^checkpoint-(\d+)$")


def trainable(engine: Engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def save_checkpoint(engine: Engine, output_dir: Path, step: int, meta: dict, keep: int) -> Optional[Path]:
    """Collective: every rank calls it. Returns the final directory on rank 0."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp"
    if engine.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.barrier()
    params, states = {}, {}
    for name, p in trainable(engine):  # gathering is collective under ZeRO-3: same order on all ranks
        params[name] = engine.get_master(p)
        for key in STATE_KEYS:
            value = engine.get_state(p, key)
            if value is not None:
                states[f"{name}::{key}"] = value
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    _save(rng, tmp / f"rng-rank{engine.rank}.safetensors")
    if engine.rank == 0:
        _save(params, tmp / "trainable.safetensors")
        _save(states, tmp / "optimizer.safetensors")
    engine.barrier()
    if engine.rank != 0:
        return None
    meta = {**meta, "step": step, "optimizer_steps": engine.get_steps(), "world_size": engine.world_size}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(output_dir)
    for old in sorted(complete_checkpoints(output_dir))[:-keep] if keep > 0 else []:
        shutil.rmtree(output_dir / f"checkpoint-{old}", ignore_errors=True)
    return final


def complete_checkpoints(output_dir: Path) -> list[int]:
    """Steps of checkpoints that finished writing (renamed, with meta.json)."""
    if not output_dir.is_dir():
        return []
    steps = []
    for path in output_dir.iterdir():
        match = _NAME.match(path.name)
        if match and (path / "meta.json").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def find_resume(output_dir: Path, resume: str) -> Optional[Path]:
    if resume == "never":
        return None
    if resume == "auto":
        steps = complete_checkpoints(output_dir)
        return output_dir / f"checkpoint-{steps[-1]}" if steps else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise ValueError(f"train.resume={resume!r}: not a complete checkpoint directory (no meta.json); use auto, never or a checkpoint-N path")
    return path


def load_checkpoint(engine: Engine, path: Path) -> dict:
    """Collective. Restores trainable weights, optimizer moments, step counts and this rank's
    RNG; returns the saved metadata."""
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != engine.world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} processes, this run has {engine.world_size}: "
            "the data order would differ; resume with the same number of processes"
        )
    params = load_file(str(path / "trainable.safetensors"))
    states = load_file(str(path / "optimizer.safetensors"))
    engine.materialize_state()
    for name, p in trainable(engine):
        if name not in params:
            raise ValueError(f"checkpoint {path} has no tensor for trainable parameter {name}: it belongs to another recipe")
        engine.set_master(p, params[name])
        for key in STATE_KEYS:
            if f"{name}::{key}" in states:
                engine.set_state(p, key, states[f"{name}::{key}"])
    engine.set_steps(meta["optimizer_steps"])
    rng = load_file(str(path / f"rng-rank{engine.rank}.safetensors"))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return meta
