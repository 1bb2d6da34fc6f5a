"""A checkpoint's weight files, read without loading a model: which safetensors files hold the
weights, whether each is whole, and the fingerprint of the weights an adapter records of its base.

Pickled weights (``pytorch_model.bin``, ``adapter_model.bin``) are refused: unpickling can run
code, and sparse-ft reads and writes safetensors only. A file cut short fails here, in one line
naming it, not in a loader's traceback after the rest has loaded.

The fingerprint is read from the files on disk, never from a loaded model, so that it is the
same whether the model then loads whole, partitioned under ZeRO-3 or quantised to NF4, and so
that it costs milliseconds for an 8B model: a few short slices of every tensor, through the
files' memory maps. Floating-point samples are rounded to bfloat16 first, so a base and its
bfloat16 copy count as one base; any other change of the weights (another seed, another
checkpoint, a merged adapter) changes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
FINGERPRINT_VERSION = "v1"  # of the sampling below; fingerprints of another version are not compared
SAMPLE_ROWS, SAMPLE_WIDTH = 3, 64  # first, middle and last row of every tensor, 64 values each


def refuse_pickle(directory: Path, what: str) -> None:
    """``ValueError`` when ``directory`` holds pickled weights and no safetensors beside them."""
    pickled = [name for name in PICKLED if (directory / name).is_file()]
    if pickled and not any(directory.glob("*.safetensors")):
        raise ValueError(f"{what} holds pickled weights only ({pickled[0]}); sparse-ft reads safetensors only, since "
                         "unpickling can run code: convert it with save_pretrained(..., safe_serialization=True)")


def model_files(directory: Path, what: str) -> list[Path]:
    """The safetensors files of a model directory (the index's shards, or ``model.safetensors``),
    each checked whole. ``what`` names the directory in errors (``--model X``)."""
    refuse_pickle(directory, what)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{what}: {index.name} is not a safetensors index (a JSON object with a weight_map)") from None
        files = [directory / name for name in shards]
    else:
        files = [directory / SAFETENSORS] if (directory / SAFETENSORS).is_file() else []
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{what}: {index.name} names {missing[0]}, which is missing")
    for file in files:
        tensor_names(file, what)
    return files


def tensor_names(file: Path, what: str) -> list[str]:
    """The tensors of a safetensors file; ``ValueError`` naming it when it cannot be read (a
    download or copy cut short, another format under the name)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return list(f.keys())
    except Exception as err:  # SafetensorError, or an OSError reading it
        detail = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{what}: {file.name} cannot be read as safetensors ({detail}); was it cut short? "
                          "copy or download it again") from None


def local_directory(model: str) -> Optional[Path]:
    """The directory holding ``model``'s files: itself, or for a Hub id its snapshot (fetched
    when the hub is reachable: loading the model would fetch it too). None when neither."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:  # offline, unknown id, no access: the fingerprint is unknown, not an error here
        return None


def fingerprint(model: str) -> Optional[str]:
    """The weights' fingerprint (``v1:<sha256>``), or None when ``model``'s safetensors files
    cannot be found (a Hub id offline and not cached). A damaged or pickled checkpoint raises."""
    directory = local_directory(model)
    if directory is None:
        return None
    files = model_files(directory, model)
    if not files:
        return None
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    where = {name: file for file in files for name in tensor_names(file, model)}  # independent of the sharding
    handles = {}
    try:
        for name in sorted(where):
            if where[name] not in handles:
                handles[where[name]] = safe_open(str(where[name]), "pt")
            part = handles[where[name]].get_slice(name)
            shape = list(part.get_shape())
            sample = _sample(part, shape)
            if sample.is_floating_point():
                sample = sample.to(torch.bfloat16).view(torch.int16)
            digest.update(json.dumps([name, shape]).encode())
            digest.update(sample.contiguous().numpy().tobytes())
    finally:
        handles.clear()
    return f"{FINGERPRINT_VERSION}:{digest.hexdigest()}"


def _sample(part, shape: list[int]):
    """The first ``SAMPLE_WIDTH`` values of the first, middle and last row."""
    import torch

    if not shape:
        return part[...].reshape(1)
    if 0 in shape:
        return torch.zeros(0)
    rows = sorted({0, shape[0] // 2, shape[0] - 1})[:SAMPLE_ROWS]
    tail = tuple(slice(0, 1) for _ in shape[2:])
    width = (slice(0, SAMPLE_WIDTH),) if len(shape) > 1 else ()
    return torch.cat([part[(slice(r, r + 1), *width, *tail)].reshape(-1) for r in rows])
