"""The trained result: one standard PEFT adapter directory (LoRA + the trainable embeddings and
norms), plus ``sparse_ft.json`` carrying the RoPE configuration it was trained with and the
fingerprint of its base's weights, so every later load uses the same positions and base
(``sparse_ft.modeling.model_io.load_adapter_model`` reads it back).

Under ZeRO-3 each rank holds a slice of every parameter; saving without gathering writes
empty tensors (a known failure of other trainers). The trainable parameters are gathered
first, and nothing else: the frozen base never leaves its partitions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from sparse_ft.modeling import rope
from sparse_ft.modeling.model_io import META_FILE, SHAPE_KEYS
from sparse_ft.files.outputs import atomic_directory


def save_adapter(engine, directory: Path, recipe, base_path: str, *, tokenizer=None,
                 base_fingerprint: Optional[str] = None) -> Optional[Path]:
    """Collective under DeepSpeed; rank 0 writes. Atomic: a temporary directory renamed.
    ``base_fingerprint``: of the base's weight files (``sparse_ft.modeling.weight_files``), which
    evaluation and merging compare with the base they are given."""
    model = engine.module
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with engine.gathered([p for _, p in named]):
        # peft picks the adapter's tensors out of this (model-named) state dict
        state = {n: p.detach().cpu().clone() for n, p in named} if engine.rank == 0 else None
    if engine.rank != 0:
        return None
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise RuntimeError(f"refusing to save an adapter with empty tensors: {empty[:3]}")
    config = model.get_base_model().config
    meta = {
        "base_model": str(Path(base_path).resolve()) if Path(base_path).exists() else base_path,  # found from anywhere
        "base_model_given": recipe.model.name_or_path,
        "rope_parameters": rope.rope_parameters(config),
        "max_position_embeddings": config.max_position_embeddings,
        "original_context": rope.original_context(config),
        "target_length": recipe.model.target_length,
        "rope_method": recipe.model.rope_method,
        "train_attention": {"pattern": recipe.attention.pattern, **recipe.attention.params},
        "base_shape": {k: getattr(config, k, None) for k in SHAPE_KEYS},
        "base_fingerprint": base_fingerprint,
        "recipe": recipe.name,
    }
    with atomic_directory(directory) as tmp:
        model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return directory
