"""Resumable checkpoints in safetensors + JSON, never pickle, that a resume can trust.

A checkpoint is written into ``checkpoint-N.tmp`` (marked as sparse-ft's when made); only after
every rank has written its part does rank 0 write ``meta.json`` and swap the directory into
``checkpoint-N``. A crash at any moment leaves either a complete ``checkpoint-N`` or a ``.tmp``
directory that resume ignores. A directory by those names that carries neither ``meta.json`` nor
the marker is not sparse-ft's and is never removed (``is_ours``).
``meta.json`` records every file's size and sha256 and its own checksum, so a resume refuses a
checkpoint that a disk, a copy or a hand has damaged since, names the file, and falls back to
the previous one.

The tensors are full (gathered from ZeRO's partitions), so a checkpoint resumes on any number
of processes. Beside them, a fine-tuning checkpoint is a PEFT adapter (``sparse_ft.train.adapter``)
that ``eval`` and ``merge`` take like the final one.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save

from sparse_ft.config.bad_input import fail
from sparse_ft.data.token_files import sha256_file
from sparse_ft.files.outputs import OUTPUT_MARKER, fsync_dir, replace_directory, write_synced
from sparse_ft.train.adapter import ADAPTER_FILES, write_adapter
from sparse_ft.train.engine import Engine

WRITER = "sparse-ft train"  # the command named by the markers in a run's directories
STATE_KEYS = ("exp_avg", "exp_avg_sq")
# a checkpoint's files, each named here only
PREFIX = "checkpoint-"  # + the step: the directory
META = "meta.json"
TRAINABLE = "trainable.safetensors"
OPTIMIZER = "optimizer.safetensors"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
_TMP = re.compile(rf"^{PREFIX}(\d+)\.tmp$")
_PART = re.compile(rf"^({re.escape(TRAINABLE)}|{re.escape(OPTIMIZER)}|{re.escape(META)}|rng-rank\d+\.safetensors)$")


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match what its ``meta.json`` recorded."""


class CheckpointWriteError(OSError):
    """A checkpoint, or another file of a run, that could not be written (a full disk): the
    earlier checkpoints are intact, and the command says so in one line (``write_failed``)."""


class NonFiniteWeights(ValueError):
    """Trainable weights holding inf or nan: no checkpoint is written from them (an update
    that diverged would otherwise become the checkpoint a resume and the adapter start from)."""


def trainable(engine: Engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    write_synced(path, save({k: v.contiguous() for k, v in tensors.items()}))


def _json_sha256(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.safetensors"


def directory(output_dir: Path, step: int) -> Path:
    return output_dir / f"{PREFIX}{step}"


def named_checkpoint(resume: str) -> Path:
    """The checkpoint ``train.resume`` names, once it is a directory whose save finished (it
    has ``META``); otherwise the recipe error naming the key, the value and what is allowed."""
    path = Path(resume)
    if not (path / META).is_file():
        found = (f"it has no {META}: not a complete checkpoint (its save did not finish, or it is no checkpoint)"
                 if path.is_dir() else "no such directory")
        fail("train.resume", resume, f"allowed: auto, never, or a {PREFIX}N directory with {META}; {found}")
    return path


def seal(directory: Path, meta: dict, files: list[str]) -> None:
    """Write ``meta.json`` last, with the size and sha256 of ``files`` (named, not listed: a
    shared filesystem may list another node's file late) and a checksum of itself."""
    record = {**meta, "files": {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
                                for name in files}}
    record["sha256"] = _json_sha256(record)
    write_synced(directory / META, json.dumps(record, indent=1).encode())


def verify(path: Path) -> dict:
    """The checkpoint's metadata, once meta.json and every file it records match; otherwise
    :class:`CorruptCheckpoint` naming the file and what is wrong with it."""
    try:
        record = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"{path / META}: unreadable ({err})") from None
    if not isinstance(record, dict) or record.pop("sha256", None) != _json_sha256(record):
        raise CorruptCheckpoint(f"{path / META}: its checksum does not match its contents (corrupt, edited, or from an older sparse-ft)")
    for name, expected in record["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{file}: missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CorruptCheckpoint(f"{file}: {size} bytes, meta.json recorded {expected['bytes']} (truncated or overwritten)")
        if sha256_file(file) != expected["sha256"]:
            raise CorruptCheckpoint(f"{file}: its sha256 differs from the one meta.json recorded (corrupt)")
    return record


def save_checkpoint(engine: Engine, output_dir: Path, step: int, meta: dict, *, keep: int,
                    adapter: Optional[dict] = None) -> Optional[Path]:
    """Collective: every rank calls it. With ``adapter`` (its ``sparse_ft.json``) the
    checkpoint is also a PEFT adapter. Returns the final directory on rank 0; raises
    :class:`CheckpointWriteError` when a file cannot be written and :class:`NonFiniteWeights`,
    before anything is written, when a trainable weight is not finite."""
    final = directory(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        _write_parts(engine, tmp, adapter)
        if engine.rank != 0:
            return None
        files = [TRAINABLE, OPTIMIZER, *map(rng_file, range(engine.world_size)), *(ADAPTER_FILES if adapter else ())]
        seal(tmp, {**meta, "step": step, "optimizer_steps": engine.get_steps(), "world_size": engine.world_size,
                   "amp": engine.amp_state()}, files)
        fsync_dir(tmp)
        replace_directory(tmp, final)  # a checkpoint of this step that resume skipped (damaged) goes
        (final / OUTPUT_MARKER).unlink()  # meta.json names it sparse-ft's now
        fsync_dir(output_dir)
    except OSError as err:
        if engine.rank == 0 and is_ours(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed write took
        raise write_failed(output_dir, final, err) from err
    for old in sorted(complete_checkpoints(output_dir))[:-keep] if keep > 0 else []:
        shutil.rmtree(directory(output_dir, old), ignore_errors=True)
    return final


def write_failed(output_dir: Path, target: Path, err: OSError) -> CheckpointWriteError:
    """The one line for a write of the run that failed: what, why, and the checkpoints kept."""
    steps = complete_checkpoints(output_dir)
    kept = f"the earlier checkpoints are intact (latest: {directory(output_dir, steps[-1]).name})" if steps else "no earlier checkpoint"
    return CheckpointWriteError(f"could not write {target}: {err.strerror or err}"
                                f"{f' ({err.filename})' if err.filename and str(err.filename) != str(target) else ''}; "
                                f"{kept}: free the space and relaunch to resume")


def _write_parts(engine: Engine, tmp: Path, adapter: Optional[dict]) -> None:
    """Each rank's RNG; on rank 0 the full trainable tensors and Adam's moments, and the
    adapter made of those tensors, once every rank found them finite."""
    params, states = {}, {}
    for name, p in trainable(engine):  # gathering is collective under ZeRO-3: same order on all ranks
        params[name] = engine.get_master(p)
        for key in STATE_KEYS:
            value = engine.get_state(p, key)
            if value is not None:
                states[f"{name}::{key}"] = value
    bad = next((name for name, value in params.items() if not torch.isfinite(value).all()), None)
    if engine.agree([bad is not None])[0]:
        raise NonFiniteWeights(f"non-finite values in {bad or 'the weights (found on another rank)'}")
    if engine.rank == 0:
        if is_ours(tmp):  # a save a crash interrupted
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / OUTPUT_MARKER).write_text(WRITER + "\n")
    engine.barrier()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    _save(rng, tmp / rng_file(engine.rank))
    if engine.rank == 0:
        _save(params, tmp / TRAINABLE)
        _save(states, tmp / OPTIMIZER)
        if adapter is not None:
            write_adapter(engine.module, params, tmp, adapter)
    engine.barrier()


def is_ours(path: Path) -> bool:
    """A checkpoint sparse-ft wrote: ``checkpoint-N`` with ``meta.json`` (damaged or not), or a
    save in progress, ``checkpoint-N.tmp`` with the marker (or, from before saves marked theirs,
    holding nothing but a checkpoint's files). A user's
    ``checkpoint-best``, another trainer's ``checkpoint-500``: not. (A link to a checkpoint is
    read through, never written through: it is replaced or removed as a link.)"""
    if not path.is_dir():
        return False
    if _NAME.match(path.name):
        return (path / META).is_file()
    return bool(_TMP.match(path.name)) and ((path / OUTPUT_MARKER).is_file() or all(_PART.match(p.name) for p in path.iterdir()))


def _named_like_ours(output_dir: Path) -> list[Path]:
    """Everything in ``output_dir`` with a name a save writes, by step."""
    found = [p for p in output_dir.glob(f"{PREFIX}*") if _NAME.match(p.name) or _TMP.match(p.name)] if output_dir.is_dir() else []
    return sorted(found, key=lambda p: (int(re.sub(r"\D", "", p.name)), p.name))


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Every directory a run's checkpointing made (complete, half-written or ``.tmp``), by step."""
    return [p for p in _named_like_ours(output_dir) if is_ours(p)]


def foreign_checkpoints(output_dir: Path) -> list[Path]:
    """What has a checkpoint's name in ``output_dir`` but is not sparse-ft's: a save would
    replace it."""
    return [p for p in _named_like_ours(output_dir) if not is_ours(p)]


def complete_checkpoints(output_dir: Path) -> list[int]:
    """Steps of checkpoints that finished writing (renamed, with meta.json)."""
    steps = []
    for path in checkpoint_dirs(output_dir):
        match = _NAME.match(path.name)
        if match and (path / META).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def find_resume(output_dir: Path, resume: str) -> Optional[Path]:
    """The verified checkpoint ``train.resume`` names: with ``auto`` the newest usable one in
    ``output_dir``, each unusable newer one reported in a line."""
    if resume == "never":
        return None
    if resume != "auto":
        path = named_checkpoint(resume)
        verify(path)
        return path
    problems = []
    for step in reversed(complete_checkpoints(output_dir)):
        path = directory(output_dir, step)
        try:
            verify(path)
        except CorruptCheckpoint as err:
            problems.append(str(err))
            print(f"train.resume=auto: skipping {path.name}: {err}", flush=True)
            continue
        return path
    if problems:
        raise CorruptCheckpoint(
            f"train.resume=auto: no usable checkpoint in {output_dir} ({'; '.join(problems)}); move them away to start afresh, "
            "or delete them with train.resume=never train.overwrite_output_dir=true"
        )
    return None


def read_meta(path: Path) -> dict:
    """The metadata of a checkpoint :func:`find_resume` verified."""
    return json.loads((path / META).read_text())


def load_checkpoint(engine: Engine, path: Path) -> dict:
    """Collective. Restores trainable weights, optimizer moments, step counts and this rank's
    RNG (a rank the checkpoint's run did not have keeps its own); returns the saved metadata."""
    meta = read_meta(path)
    params = load_file(str(path / TRAINABLE))
    states = load_file(str(path / OPTIMIZER))
    for name, p in trainable(engine):
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape there
        if name not in params or tuple(params[name].shape) != shape:
            found = f"a tensor of shape {tuple(params[name].shape)}" if name in params else "no tensor"
            raise ValueError(f"train.resume: {path} has {found} for the trainable parameter {name} of shape {shape}: "
                             "it was trained on another model or adapter; start afresh in a new train.output_dir")
    engine.materialize_state()
    for name, p in trainable(engine):
        engine.set_master(p, params[name])
        for key in STATE_KEYS:
            if f"{name}::{key}" in states:
                engine.set_state(p, key, states[f"{name}::{key}"])
    engine.set_steps(meta["optimizer_steps"])
    engine.load_amp_state(meta["amp"])
    if engine.rank < meta["world_size"]:
        rng = load_file(str(path / rng_file(engine.rank)))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta
