"""One interface over the two ways a step runs: DeepSpeed (ZeRO 2/3, offload) or plain torch
(one process, no DeepSpeed). The optimizer (AdamW with the recipe's settings) and the
learning-rate schedule are the recipe's in both: the schedule is built here, never taken
from a DeepSpeed config.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from sparse_ft.config import Recipe


def schedule(recipe: Recipe, total_steps: int):
    """lr multiplier per optimizer step: linear warmup, then constant / linear / cosine decay."""
    warmup, kind = recipe.train.warmup_steps, recipe.train.scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Engine:
    """Micro-step (forward+backward), optimizer step at accumulation boundaries, and access to
    full (gathered) trainable tensors for adapters and checkpoints."""

    world_size = 1
    rank = 0

    def __init__(self, model: torch.nn.Module, recipe: Recipe, total_steps: int) -> None:
        self.model = model
        self.accum = recipe.train.gradient_accumulation_steps
        self.max_grad_norm = recipe.train.max_grad_norm
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay,
                                           betas=tuple(recipe.train.betas), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule(recipe, total_steps))

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def micro_step(self, batch: dict) -> float:
        loss = self.model(**batch).loss
        (loss / self.accum).backward()
        return loss.item()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    @contextmanager
    def gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        yield

    # full trainable tensors (fp32 master where one exists) and optimizer state
    def get_master(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p.detach().float().cpu()

    def set_master(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            p.copy_(value.to(p.dtype))

    def get_state(self, p: torch.nn.Parameter, key: str) -> Optional[torch.Tensor]:
        state = self.optimizer.state.get(p, {})
        return state[key].detach().cpu() if key in state else None

    def set_state(self, p: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        self.optimizer.state.setdefault(p, {})[key] = value.to(p.device)

    def _base_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def _state_keys(self) -> list[torch.Tensor]:
        """The tensors the base optimizer keeps Adam state for."""
        return [p for group in self._base_optimizer().param_groups for p in group["params"]]

    def _step_value(self, steps: int):
        """torch's Adam keeps ``step`` as a tensor; DeepSpeed's CPU/fused Adam as an int."""
        torch_own = type(self._base_optimizer()).__module__.startswith("torch.optim")
        return torch.tensor(float(steps)) if torch_own else steps

    def materialize_state(self) -> None:
        """Adam creates its state lazily at the first step; a resume writes into it before."""
        base = self._base_optimizer()
        for p in self._state_keys():
            if not base.state.get(p):
                base.state[p] = {"step": self._step_value(0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}

    def get_steps(self) -> int:
        return self.scheduler.last_epoch

    def set_steps(self, steps: int) -> None:
        """Optimizer steps taken: AdamW's bias correction and the schedule's position."""
        for state in self._base_optimizer().state.values():
            state["step"] = self._step_value(steps)
        self.scheduler.last_epoch = steps
        lrs = [base * self.scheduler.lr_lambdas[0](steps) for base in self.scheduler.base_lrs]
        self.scheduler._last_lr = lrs
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr


class DeepSpeedEngine(Engine):
    def __init__(self, model: torch.nn.Module, recipe: Recipe, total_steps: int, ds_config: dict) -> None:
        import deepspeed

        self.accum = recipe.train.gradient_accumulation_steps
        trainable = [p for p in model.parameters() if p.requires_grad]
        factor = schedule(recipe, total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=trainable, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
        )
        self.model = model
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def micro_step(self, batch: dict) -> float:
        loss = self.engine(**batch).loss
        self.engine.backward(loss)
        self.engine.step()  # DeepSpeed steps the optimizer itself at accumulation boundaries
        return loss.item()

    def optimizer_step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def mean(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size

    def barrier(self) -> None:
        dist.barrier()

    @contextmanager
    def gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, enabled=self.zero3):
            yield

    def get_master(self, p):
        from deepspeed.utils import safe_get_full_fp32_param

        value = safe_get_full_fp32_param(p)
        return value.detach().float().cpu() if value is not None else super().get_master(p)

    def set_master(self, p, value):
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        # the fp32 master the optimizer updates, and the working copy the forward pass reads
        safe_set_full_fp32_param(p, value.to(self.engine.device))
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=self.zero3):
            if self.rank == 0 or not self.zero3:
                with torch.no_grad():
                    p.copy_(value.to(p.device, p.dtype).view_as(p))

    def _base_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _state_keys(self) -> list[torch.Tensor]:
        # ZeRO-3 hands its flat fp32 partitions to the base optimizer only during a step
        return list(self.optimizer.fp32_partitioned_groups_flat) if self.zero3 else super()._state_keys()

    def materialize_state(self) -> None:
        super().materialize_state()
        # ZeRO-1/2 and the bf16 optimizer map each parameter onto its slice of the state only
        # after a first step; map the state created above the same way
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()

    def get_state(self, p, key):
        from deepspeed.utils import safe_get_full_optimizer_state

        value = safe_get_full_optimizer_state(p, key)
        return value.detach().float().cpu() if value is not None else None

    def set_state(self, p, key, value):
        from deepspeed.utils import safe_set_full_optimizer_state

        safe_set_full_optimizer_state(p, value.to(self.engine.device), key)

    def set_steps(self, steps: int) -> None:
        super().set_steps(steps)
        self.engine.global_steps = steps
        self.engine.global_samples = steps * self.engine.train_batch_size()
