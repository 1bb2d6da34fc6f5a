"""DeepSpeed Ulysses sequence parallelism (``train.sequence_parallel_size`` > 1), glue only.

DeepSpeed's ``UlyssesSPAttentionHF`` wraps the model's attention function: each rank holds
N/sp tokens of a sequence, and around attention an all-to-all gives it the whole sequence for
H/sp heads. Every pattern is defined per head on the whole sequence, so the rank runs the
pattern on its own heads (``Pattern.heads``); all it needs is which heads those are, which the
core attention below adds. DeepSpeed's ``UlyssesSPDataLoaderAdapter`` shards each batch over
the ranks of an SP group; the loss is the group's token mean. Data parallelism runs across
groups (world / sp of them).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Iterator

import torch

from sparse_ft.modeling.attention import IMPLEMENTATION, pretrained, sparse_ft_attention
from sparse_ft.config import Recipe
from sparse_ft.train.deepspeed import DeepSpeedEngine


def _rank_heads(core: Callable, module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any):
    """The toolkit's attention told which heads Ulysses handed this rank: heads
    ``[sp_rank * H/sp, ...)`` of H. (With fewer than H heads only in training: evaluation
    runs whole sequences on every rank, DeepSpeed's ``disable_in_eval``.)"""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    total = module.config.num_attention_heads
    if query.shape[1] != total:
        kwargs.update(head_offset=mpu.get_sequence_parallel_rank() * query.shape[1], num_heads=total)
    return core(module, query, *args, **kwargs)


def register(model: torch.nn.Module, recipe: Recipe):
    """Make Ulysses the model's attention around its core attention (the toolkit's for a
    pattern, the model's own for ``full``) and create the SP groups; returns DeepSpeed's
    mpu for ``deepspeed.initialize``. After ``install_method``, before the engine."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = pretrained(model)
    core = base.config._attn_implementation
    if core == IMPLEMENTATION:  # DeepSpeed wraps whatever this name maps to when it registers
        ALL_ATTENTION_FUNCTIONS[core] = functools.partial(_rank_heads, sparse_ft_attention)
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=base, core_attn_implementation=core,
        sequence_parallel_size=recipe.train.sequence_parallel_size,
        micro_batch_size=recipe.train.per_device_batch_size, seq_length=recipe.seq_len,
        seq_length_is_variable=False, disable_in_eval=True,
    )


def shard_batches(rows: Callable[[int], dict], device: torch.device) -> Iterator[dict]:
    """This rank's shards of its SP group's micro-batches. The adapter takes one batch from
    each rank of the group in turn (``rows(m)``: this rank's m-th) and hands every rank its
    slice of it, so group micro-batch t is rank t % sp's batch t // sp."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    sp = mpu.get_sequence_parallel_world_size()

    def with_positions(batch: dict) -> dict:  # the adapter needs global positions to shard
        rows, n = batch["input_ids"].shape  # padding-free samples bring their own, restarting per document
        return {"position_ids": torch.arange(n).repeat(rows, 1), **batch}

    source = (with_positions(rows(m)) for m in itertools.count())
    adapter = UlyssesSPDataLoaderAdapter(source, mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group(), sp, device)
    return ({k: v.to(device) for k, v in shard.items()} for shard in adapter)


class UlyssesEngine(DeepSpeedEngine):
    """DeepSpeed with the SP groups, and the loss of a sequence split over an SP group."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, *, ds_config: dict, mpu: Any) -> None:
        super().__init__(model, recipe, ds_config=ds_config)
        self.mpu = mpu

    def loss(self, batch: dict) -> torch.Tensor:
        """The group's token mean as DeepSpeed and HF document it: each rank's token mean
        weighted by its tokens, gathered with gradient (torch.distributed.nn), so every rank
        back-propagates the whole group loss. DeepSpeed's gradient reduction expects that:
        with the weights gathered without gradient instead, the gradient norm came out 1/sp of
        the single-process one (0.897 against 1.795, tiny recipe, sp=2)."""
        from torch.distributed.nn.functional import all_gather

        labels = batch["shift_labels"]
        loss = super().loss({**batch, "labels": labels})
        group = self.mpu.get_sequence_parallel_group()
        tokens = torch.stack(all_gather((labels != -100).sum(), group=group))
        losses = torch.stack(all_gather(loss, group=group))
        return torch.where(tokens > 0, losses, 0.0).mul(tokens).sum() / tokens.sum().clamp(min=1)
