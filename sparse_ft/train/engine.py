"""One interface over the two ways a step runs: plain torch (one process, no DeepSpeed) here,
and DeepSpeed (ZeRO 2/3, offload) in ``sparse_ft.train.deepspeed``, which subclasses it. The
optimizer (AdamW with the recipe's settings) and the learning-rate schedule are the recipe's
in both: the schedule is built here, never taken from a DeepSpeed config.

Plain torch with a bf16/fp16 model trains as HF Trainer does: the trainable parameters are fp32
(the masters) and the forward runs under autocast in the model's dtype, with a loss scale for
fp16. Updated in half precision, a norm weight near 1 never moves at a 7B recipe's lr (2e-5 is
below half of bf16's spacing there, 2^-8). DeepSpeed keeps its own fp32 masters and loss scale.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from sparse_ft.config import Recipe, TrainSection
from sparse_ft.modeling.dtypes import torch_dtype
from sparse_ft.train.loss import training_loss


def schedule(train: TrainSection, total_steps: int) -> Callable[[int], float]:
    """lr multiplier per optimizer step: linear warmup, then constant, or linear / cosine decay
    to ``train.min_lr_ratio``. The one schedule of the toolkit: fine-tuning and pretraining."""
    warmup, kind, floor = train.warmup_steps, train.scheduler, train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * decay  # exactly ``decay`` when floor is 0

    return factor


def param_groups(trainable: list[torch.nn.Parameter], train: TrainSection) -> list:
    """AdamW's parameters: all in one group, or with ``train.weight_decay_on: matrices`` the
    vectors (norm weights, biases) in a second group that never decays, as pretraining has
    it. Shapes are read as DeepSpeed's ZeRO-3 records them before it partitions a tensor."""
    if train.weight_decay_on == "all":
        return trainable
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in trainable]
    matrices = [p for p, matrix in zip(trainable, is_matrix) if matrix]
    vectors = [p for p, matrix in zip(trainable, is_matrix) if not matrix]
    return [group for group in ({"params": matrices}, {"params": vectors, "weight_decay": 0.0}) if group["params"]]


class Engine:
    """Micro-step (forward+backward), optimizer step at accumulation boundaries, and access to
    full (gathered) trainable tensors for adapters and checkpoints. Built in two explicit
    steps by :meth:`build`: the constructor sets attributes only (a subclass sets its own after
    ``super().__init__``, as usual), then :meth:`prepare` runs the steps a subclass overrides
    (mixed precision, the optimizer and its schedule), on a fully constructed engine."""

    world_size = 1
    rank = 0

    def __init__(self, model: torch.nn.Module, recipe: Recipe) -> None:
        self.model = model
        self.accum = recipe.train.gradient_accumulation_steps
        self.max_grad_norm = recipe.train.max_grad_norm
        self.dtype = torch_dtype(recipe.model.dtype)
        self.loss_function = training_loss(model, recipe.train.loss, recipe.train.loss_chunk_tokens)
        self.overflowed = False  # fp16: the loss scaler skipped the last step

    @classmethod
    def build(cls, model: torch.nn.Module, recipe: Recipe, total_steps: int, **options: Any) -> "Engine":
        """The engine ready to step: constructed (``options``: a subclass's own constructor
        arguments), then prepared for ``total_steps`` optimizer steps."""
        engine = cls(model, recipe, **options)
        engine.prepare(recipe, total_steps)
        return engine

    def prepare(self, recipe: Recipe, total_steps: int) -> None:
        """fp32 masters (and fp16's loss scale) for the trainable parameters, then the
        optimizer and the learning-rate schedule over them."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.scaler = self._mixed_precision(trainable)
        groups = param_groups(trainable, recipe.train)
        self.optimizer, self.scheduler = self._build_optimizer(groups, recipe, schedule(recipe.train, total_steps))

    def _mixed_precision(self, trainable: list[torch.nn.Parameter]) -> Optional[torch.amp.GradScaler]:
        """fp32 masters for a half-precision model; fp16's loss scaler (gradients below its
        smallest normal would vanish)."""
        if self.dtype == torch.float32:
            return None
        for p in trainable:
            p.data = p.data.float()
        return torch.amp.GradScaler(trainable[0].device.type) if self.dtype == torch.float16 else None

    def _build_optimizer(self, groups: list, recipe: Recipe,
                         factor: Callable[[int], float]) -> tuple[torch.optim.Optimizer, LambdaLR]:
        """The optimizer over ``groups`` (:func:`param_groups`) and the schedule that scales its
        lr by ``factor``."""
        optimizer = torch.optim.AdamW(groups, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay,
                                      betas=tuple(recipe.train.betas), eps=1e-8)
        return optimizer, LambdaLR(optimizer, factor)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def autocast(self) -> ContextManager:
        """Where the model runs forward: in its own dtype, over fp32 masters."""
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=self.dtype, enabled=self.dtype != torch.float32)

    @property
    def forward(self) -> Callable:
        """The model as a step calls it (DeepSpeed's engine around it, under DeepSpeed)."""
        return self.model

    def loss(self, batch: dict) -> torch.Tensor:
        """The micro-batch's mean token loss (``train.loss``)."""
        with self.autocast():
            return self.loss_function(self.forward, self.module, batch)

    def micro_step(self, batch: dict) -> float:
        loss = self.loss(batch)
        scaled = loss / self.accum
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.item()

    def optimizer_step(self) -> float:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
            self.scaler.update()
            self.overflowed = self.scaler.get_scale() < scale  # lowered only after an overflow
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def non_finite_norm_expected(self) -> bool:
        """Whether a non-finite gradient norm of the last step is no divergence: fp16's loss
        scaler found its scaled gradients overflowing and skipped the step (nothing applied, the
        scale halved), as it does while the scale settles. Not once the scale is below 1: then
        the gradients overflow unscaled, which no scale fixes (DeepSpeed's ``min_loss_scale``,
        1 by default, stops there too)."""
        return self.overflowed and self.scaler.get_scale() >= 1

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def mean(self, value: float) -> float:
        return value

    def agree(self, values: list[int]) -> list[int]:
        """Each value's maximum over the ranks: what one rank saw (a signal, its save clock, a
        non-finite number) every rank acts on, at the same step. One process: the values."""
        return [int(v) for v in values]

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

    def amp_state(self) -> dict:
        """fp16's loss scale and the optimizer updates it let through (fewer than the steps
        when some overflowed): a resume needs both to continue exactly. JSON."""
        if self.scaler is None:
            return {}
        updates = [int(state["step"]) for state in self.optimizer.state.values()]
        return {"grad_scaler": self.scaler.state_dict(), "updates": updates[0] if updates else 0}

    def load_amp_state(self, state: dict) -> None:
        if self.scaler is None or not state:  # not state: a checkpoint of another dtype, allowed by the recipe
            return
        self.scaler.load_state_dict(state["grad_scaler"])
        for param_state in self.optimizer.state.values():
            param_state["step"] = self._step_value(state["updates"])

    def get_steps(self) -> int:
        return self.scheduler.last_epoch

    def set_steps(self, steps: int) -> None:
        """Optimizer steps taken: AdamW's bias correction and the schedule's position."""
        for state in self._base_optimizer().state.values():
            state["step"] = self._step_value(steps)
        position = self.scheduler.state_dict()
        position["last_epoch"] = steps - 1
        self.scheduler.load_state_dict(position)
        with warnings.catch_warnings():
            # this step only moves the schedule to where the checkpoint left it; no update is skipped
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
            self.scheduler.step()  # sets every group's lr for step ``steps``
