"""Activation memory at long context, traded for time with the trained numbers unchanged:

- ``train.offload_activations``: gradient checkpointing keeps one tensor per decoder layer for
  backward, the layer's input (``N × H``), which at 128k tokens and 32 layers of 4096 is 32 GiB
  in bf16. Offloaded, each layer's checkpoint holds a CPU copy of its input instead, copied back
  when backward recomputes the layer (as ALST does), so the GPU holds one layer's input at a
  time. On a CPU the copy is the tensor itself.
- ``train.mlp_tile_tokens``: a decoder MLP's intermediate activations (``N × I`` for the gate,
  the up projection, the activation and their product) are the largest a recomputed layer
  holds. Tiled, each MLP runs over tiles of the sequence, each tile under a checkpoint, so only
  one tile's intermediates exist at a time, forward or backward (ALST's TiledMLP). A token's
  MLP output depends on that token alone, so the tiles give the same numbers.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparse_ft.config import TrainSection


def reduce_activation_memory(model: nn.Module, train: TrainSection) -> nn.Module:
    """``model`` with the recipe's activation keys applied (after gradient checkpointing and
    the adapters are in place)."""
    if train.offload_activations:
        offload_checkpoints(model)
    if train.mlp_tile_tokens:
        tile_mlps(model, train.mlp_tile_tokens)
    return model


def offload_checkpoints(model: nn.Module) -> int:
    """Every checkpointed decoder layer keeps its input in CPU memory; returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError("recipe key train.offload_activations=True is invalid: the model has no checkpointed decoder "
                         "layers (transformers' GradientCheckpointingLayer) whose inputs could go to the CPU")
    for layer in layers:
        layer._gradient_checkpointing_func = partial(_offloaded, layer._gradient_checkpointing_func)
    return len(layers)


def _offloaded(run_checkpoint: Callable, function: Callable, *args: Any) -> Any:
    """The checkpoint saves the layer's inputs under torch's ``save_on_cpu`` hooks: copied to
    pinned host memory (reused from step to step) and back when backward recomputes the layer.
    Only the saved copy moves: the gradient stays on the device. The former copies (pageable,
    fresh each step, the gradient through the host as well) made a 1B step at 8k-16k ~10x
    slower than the chunked loss alone on an H200; these cost 10% at 32k
    (results/bench/memory-h200.md)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return run_checkpoint(function, *args)


def tile_mlps(model: nn.Module, tile_tokens: int) -> int:
    """Every decoder layer's ``mlp`` computed over tiles of ``tile_tokens`` positions; returns
    how many. The module stays (its parameters' names, PEFT's and ZeRO-3's hooks): only its
    ``forward`` is wrapped."""
    mlps = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    if not mlps:
        raise ValueError(f"recipe key train.mlp_tile_tokens={tile_tokens} is invalid: the model has no decoder "
                         "modules named mlp to tile; use 0")
    for mlp in mlps:
        mlp.forward = partial(_tiled, mlp.forward, tile_tokens)
    return len(mlps)


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile_tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` over tiles of the sequence (dimension -2), each recomputed in backward.
    ZeRO-3 re-partitions a weight once a recomputed tile is done with it, so the checkpoint's
    check of recomputed metadata is off (the recomputation is the same computation)."""
    if hidden.shape[-2] <= tile_tokens or not torch.is_grad_enabled():
        return forward(hidden)
    tiles = [checkpoint(forward, tile, use_reentrant=False, determinism_check="none")
             for tile in hidden.split(tile_tokens, dim=-2)]
    return torch.cat(tiles, dim=-2)
