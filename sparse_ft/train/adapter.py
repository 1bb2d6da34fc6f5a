"""The trained result: one standard PEFT adapter directory (LoRA + the trainable embeddings and
norms), plus ``sparse_ft.json`` carrying the RoPE configuration it was trained with and the
fingerprint of its base's weights, so every later load uses the same positions and base
(``sparse_ft.modeling.model_io.load_adapter_model`` reads it back). For loading without
sparse-ft the directory also carries ``config.json`` (the base's config with the RoPE
extension, which ``AutoConfig.from_pretrained(adapter_dir)`` reads) and a model card saying how
(``sparse_ft.train.model_card``). The final adapter is one;
every checkpoint holds one too (``write_adapter``), so that ``eval`` and ``merge`` take any
checkpoint of a run.

Under ZeRO-3 each rank holds a slice of every parameter; saving without gathering writes
empty tensors (a known failure of other trainers). The trainable parameters are gathered
first, and nothing else: the frozen base never leaves its partitions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from sparse_ft.modeling import rope
from sparse_ft.modeling.model_io import META_FILE, SHAPE_KEYS, adapter_base_config
from sparse_ft.files.outputs import atomic_directory, os_error

from sparse_ft.train.model_card import CARD, write_model_card

# what write_adapter writes
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", META_FILE, "config.json", CARD)



def adapter_meta(model, recipe, base_path: str, base_fingerprint: Optional[str]) -> dict:
    """``sparse_ft.json``: what the adapter was trained on and with, positions first.
    ``base_fingerprint``: of the base's weight files (``sparse_ft.modeling.weight_files``), which
    evaluation and merging compare with the base they are given."""
    config = model.get_base_model().config
    return {
        "base_model": str(Path(base_path).resolve()) if Path(base_path).exists() else base_path,  # found from anywhere
        "base_model_given": recipe.model.name_or_path,
        "rope_parameters": rope.rope_parameters(config),
        "max_position_embeddings": config.max_position_embeddings,
        "original_context": rope.original_context(config),
        "target_length": recipe.model.target_length,
        "rope_method": recipe.model.rope_method,
        "train_attention": {"pattern": recipe.attention.pattern, **recipe.attention.params},
        # where it attended fully instead (sparse_ft.methods.dense_layers): the probe's logits are the last step's
        "train_full_attention": {"dense_layers": recipe.attention.dense_layers,
                                 "dense_final_fraction": recipe.train.dense_final_fraction},
        "base_shape": {k: getattr(config, k, None) for k in SHAPE_KEYS},
        "base_fingerprint": base_fingerprint,
        "base_quantization": recipe.model.quantization,  # nf4: trained over the NF4-rounded base (docs/training.md)
        "recipe": recipe.name,
    }


def write_adapter(model, state: dict[str, torch.Tensor], directory: Path, meta: dict) -> None:
    """``model``'s adapter with the full trainable tensors ``state`` (named as in ``model``)
    into ``directory``, which the caller renames into place."""
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise RuntimeError(f"refusing to save an adapter with empty tensors: {empty[:3]}")
    try:  # peft picks the adapter's tensors out of this (model-named) state dict
        model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    except Exception as err:  # safetensors reports a full disk as a SafetensorError: an OSError here
        failed = os_error(err, directory / ADAPTER_FILES[1])
        if failed is None:
            raise
        raise failed from err
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))
    adapter_base_config(type(model.get_base_model().config), meta).save_pretrained(str(directory))
    write_model_card(directory, meta)  # replaces PEFT's empty template


def save_adapter(engine, directory: Path, meta: dict, *, tokenizer=None) -> Optional[Path]:
    """Collective under DeepSpeed; rank 0 writes. Atomic: a temporary directory renamed."""
    model = engine.module
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with engine.gathered([p for _, p in named]):
        state = {n: p.detach().cpu().clone() for n, p in named} if engine.rank == 0 else None
    if engine.rank != 0:
        return None
    with atomic_directory(directory) as tmp:
        write_adapter(model, state, tmp, meta)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return directory
