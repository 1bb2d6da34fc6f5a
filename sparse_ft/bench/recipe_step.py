"""A training step as ``sparse-ft train`` builds and takes it, for the scripts that measure
memory at the allocator (scripts/bench_memory.py, scripts/fit_length.py): the recipe's model
(``build_model``: LoRA+, gradient checkpointing, the activation keys, an NF4 base), fp32
trainable masters, the recipe's loss under autocast. No optimizer update: a caller that wants
AdamW's state steps its own once."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from sparse_ft.config import Recipe
from sparse_ft.train.loss import training_loss
from sparse_ft.train.model_setup import build_model, training_method


def recipe_step(recipe: Recipe, model_dir: Path, device: torch.device) -> tuple[nn.Module, Callable[[int], None]]:
    """The model on ``device`` and ``step(n)``: forward and backward over ``n`` random tokens
    (drawn once per ``n``, seeded by it), the gradients added to those already held."""
    model = build_model(recipe, str(model_dir), training_method(recipe)).to(device).train()
    half = recipe.model.dtype != "float32"
    if half:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # fp32 masters, as the trainer keeps them
    loss_fn = training_loss(model, recipe.train.loss, recipe.train.loss_chunk_tokens)
    vocab, dtype = model.config.vocab_size, getattr(torch, recipe.model.dtype)
    tokens: dict[int, torch.Tensor] = {}

    def step(n: int) -> None:
        if n not in tokens:
            tokens[n] = torch.randint(0, vocab, (1, n), device=device, generator=torch.Generator(device=device).manual_seed(n))
        with torch.autocast(device.type, dtype=dtype, enabled=half):
            loss = loss_fn(model, model, {"input_ids": tokens[n], "labels": tokens[n]})
        loss.backward()

    return model, step
