"""Training under DeepSpeed: the recipe's DeepSpeed config resolved for this launch ("auto"s
filled from the recipe, the world size, the optimizer for this hardware), and the engine that
steps through DeepSpeed. ``deepspeed`` itself is imported only when a run uses it."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from sparse_ft.config import Recipe
from sparse_ft.config.deepspeed_file import RECIPE_OWNED, is_auto, read_deepspeed_config
from sparse_ft.train.engine import Engine


def resolve_deepspeed_config(recipe: Recipe, world_size: int, on_cuda: Optional[bool] = None) -> dict:
    """The recipe's DeepSpeed config with every "auto" filled from the recipe, so the optimizer
    (AdamW with the recipe's lr), batch sizes and clipping are the recipe's. The schedule is
    built by the trainer from ``train.scheduler``, never by the config. ``on_cuda`` (default:
    whether CUDA is available) picks DeepSpeed's fused Adam or torch's AdamW.

    The file was checked against the recipe when the recipe loaded (``sparse_ft.config.schema``,
    once per run); what only the world size decides, the global batch, is checked here."""
    if recipe.deepspeed is None:
        raise ValueError("recipe key deepspeed=None: this recipe trains without DeepSpeed")
    if on_cuda is None:
        on_cuda = torch.cuda.is_available()
    config = read_deepspeed_config(recipe.deepspeed)
    t = recipe.train
    data_parallel = world_size // t.sequence_parallel_size  # an SP group's ranks share each batch
    global_batch = t.per_device_batch_size * t.gradient_accumulation_steps * data_parallel
    if "train_batch_size" in config and not is_auto(config["train_batch_size"]) and config["train_batch_size"] != global_batch:
        raise ValueError(
            f"deepspeed config {recipe.deepspeed} sets train_batch_size={config['train_batch_size']} but per_device_batch_size "
            f"{t.per_device_batch_size} × gradient_accumulation_steps {t.gradient_accumulation_steps} × {data_parallel} "
            f"data-parallel processes = {global_batch}; write \"auto\" there"
        )
    config.pop("scheduler", None)
    for key, owned in RECIPE_OWNED.items():
        config[key] = owned(t)
    config["train_batch_size"] = global_batch
    offload = "offload_optimizer" in config.get("zero_optimization", {})
    config["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": t.lr, "weight_decay": t.weight_decay, "betas": list(t.betas), "eps": 1e-8,
                   # FusedAdam needs CUDA and offload needs DeepSpeedCPUAdam; torch's AdamW runs anywhere else
                   "torch_adam": not on_cuda and not offload},
    }
    config.setdefault("steps_per_print", 10**9)
    return config


class DeepSpeedEngine(Engine):
    """DeepSpeed steps the optimizer itself at accumulation boundaries and partitions the
    trainable tensors (ZeRO); the accessors gather them for checkpoints and adapters. ``mpu``:
    the sequence-parallel groups, when there are (``sparse_ft.train.sequence_parallel``)."""

    mpu = None

    def __init__(self, model: torch.nn.Module, recipe: Recipe, *, ds_config: dict) -> None:
        super().__init__(model, recipe)
        self.ds_config = ds_config
        self.zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

    def _mixed_precision(self, trainable):
        return None  # DeepSpeed keeps the fp32 masters and the loss scale itself

    def autocast(self):
        return nullcontext()  # the engine casts the model to the config's precision

    def _build_optimizer(self, groups, recipe, factor):
        import deepspeed

        self.engine, optimizer, _, scheduler = deepspeed.initialize(
            model=self.model, model_parameters=groups, config=self.ds_config,
            lr_scheduler=lambda opt: LambdaLR(opt, factor), mpu=self.mpu,
        )
        return optimizer, scheduler

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def forward(self):
        return self.engine

    def micro_step(self, batch: dict) -> float:
        loss = self.loss(batch)
        self.engine.backward(loss)
        self.engine.step()  # DeepSpeed steps the optimizer itself at accumulation boundaries
        return loss.item()

    def optimizer_step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def non_finite_norm_expected(self) -> bool:
        """DeepSpeed skips a step whose gradient norm is not finite in every precision and
        reports the norm as inf; only fp16's are loss-scale overflows, which its loss scaler
        bounds itself (it raises at ``min_loss_scale``). Also when it computed no norm (ZeRO-1/2
        ``compute_grad_norm: false``): the nan logged then means "not measured"."""
        skipped_overflow = self.engine.fp16_enabled() and not self.engine.was_step_applied()
        return skipped_overflow or self.engine.get_global_grad_norm() is None

    def mean(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size

    def agree(self, values: list[int]) -> list[int]:
        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

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
