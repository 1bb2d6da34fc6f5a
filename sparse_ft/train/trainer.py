"""The training recipe as one explicit class (torchtune style): ``Trainer.run`` calls its
stages in order (processes, data, model, engine, resume, the loop, the adapter), each a short
method that a variant can override. Deterministic data order, accumulation, logging,
checkpoints and a bit-identical resume."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from sparse_ft.config import Recipe, format_recipe, save_resolved
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.models import load_tokenizer, materialize_tiny
from sparse_ft.train import checkpoint
from sparse_ft.train.adapter import save_adapter
from sparse_ft.train.deepspeed import DeepSpeedEngine, resolve_deepspeed_config
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.engine import Engine
from sparse_ft.train.metrics import MetricLog, peak_memory_mib
from sparse_ft.train.model_setup import base_model_path, build_model
from sparse_ft.train.preflight import preflight


class DataOrder:
    """Micro-batch ``m`` of rank ``r``: a fixed slice of epoch ``m // per_epoch``'s seeded
    permutation. Position alone determines the batch, so a resume skips nothing and repeats
    nothing."""

    def __init__(self, size: int, batch: int, world: int, rank: int, seed: int) -> None:
        self.size, self.batch, self.world, self.rank, self.seed = size, batch, world, rank, seed
        self.per_epoch = size // (batch * world)
        if self.per_epoch == 0:
            raise ValueError(
                f"the training set has {size} samples: fewer than per_device_batch_size={batch} × {world} processes; "
                "add data or lower data.min_tokens / data.seq_len"
            )
        self._perm: Optional[tuple[int, torch.Tensor]] = None

    def indices(self, micro: int) -> list[int]:
        epoch, within = divmod(micro, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.size, generator=gen))
        start = (within * self.world + self.rank) * self.batch
        return self._perm[1][start : start + self.batch].tolist()


def write_probe(engine: Engine, input_ids: torch.Tensor, device: torch.device, path: Path) -> None:
    """Logits of the trained model (eval mode, training pattern) on a fixed input, saved
    beside the adapter: reloading the adapter must reproduce them (a ZeRO-3 run that saved
    empty or stale tensors would not)."""
    from safetensors.torch import save_file

    model = engine.module
    model.eval()
    with torch.no_grad():  # collective under ZeRO-3: every rank runs it
        logits = model(input_ids=input_ids[None].to(device)).logits.float().cpu()
    model.train()
    if engine.rank == 0:
        save_file({"input_ids": input_ids[None].contiguous(), "logits": logits.contiguous()}, str(path))


def total_steps(recipe: Recipe, order: DataOrder) -> int:
    if recipe.train.max_steps > 0:
        return recipe.train.max_steps
    steps = recipe.train.num_epochs * order.per_epoch // recipe.train.gradient_accumulation_steps
    if steps == 0:
        raise ValueError(
            f"one epoch gives {order.per_epoch} micro-batches, fewer than train.gradient_accumulation_steps="
            f"{recipe.train.gradient_accumulation_steps}: set train.max_steps or add data"
        )
    return steps


class Trainer:
    """One run of ``recipe``: every rank constructs one and calls :meth:`run`."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.out = Path(recipe.train.output_dir)
        self.use_deepspeed = recipe.deepspeed is not None

    def run(self) -> dict:
        """Train to the end (resuming where a checkpoint allows) and save the adapter; returns
        the run's summary."""
        preflight(self.recipe)  # every bad input fails here, in one line, before anything loads or is written
        self.setup_distributed()
        self.setup_data()
        self.setup_model()
        self.setup_engine()
        self.maybe_resume()
        self.train()
        return self.save()

    def setup_distributed(self) -> None:
        """Join the process group; rank 0 prepares the output directory (resolved recipe, the
        tiny base model) while the others wait."""
        self.rank, self.world = init_distributed(self.use_deepspeed)
        self.barrier = dist.barrier if dist.is_initialized() else (lambda: None)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_resolved(self.recipe, self.out)
            print(f"recipe {self.recipe.name}:\n{format_recipe(self.recipe)}", flush=True)
            if self.recipe.model.name_or_path == "tiny":
                materialize_tiny(self.out / "base-model", self.recipe.train.seed, **self.recipe.model.tiny)
        self.barrier()

    def setup_data(self) -> None:
        """The packed training set (rank 0 tokenizes, the others then read its cache), its
        per-rank order, and the run's length in optimizer steps."""
        recipe = self.recipe
        self.base = base_model_path(recipe)
        self.tokenizer = load_tokenizer(self.base, recipe.model.trust_remote_code)
        build = lambda: build_train_dataset(recipe.data, self.tokenizer, recipe.seq_len, recipe.model.trust_remote_code)  # noqa: E731
        if self.rank == 0:
            self.dataset = build()
        self.barrier()
        if self.rank != 0:
            self.dataset = build()
        self.order = DataOrder(len(self.dataset), recipe.train.per_device_batch_size, self.world, self.rank, recipe.train.seed)
        self.steps = total_steps(recipe, self.order)
        # what fixes the data order: a resume with any of it changed would not see the same batches
        self.data_identity = {"samples": len(self.dataset), "seq_len": recipe.seq_len, "seed": recipe.train.seed,
                              "per_device_batch_size": recipe.train.per_device_batch_size,
                              "gradient_accumulation_steps": recipe.train.gradient_accumulation_steps}

    def setup_model(self) -> None:
        """Base model, position interpolation, LoRA+ and the training pattern; under ZeRO-3
        the weights load partitioned."""
        torch.manual_seed(self.recipe.train.seed)  # identical LoRA initialisation on every rank
        on_cuda = torch.cuda.is_available()
        self.ds_config = resolve_deepspeed_config(self.recipe, self.world, on_cuda) if self.use_deepspeed else None
        self.model = build_model(self.recipe, self.base, self.ds_config)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")

    def setup_engine(self) -> None:
        """The optimizer and schedule, through DeepSpeed when the recipe names a config."""
        if self.use_deepspeed:
            self.engine: Engine = DeepSpeedEngine(self.model, self.recipe, self.steps, self.ds_config)
        else:
            self.engine = Engine(self.model.to(self.device), self.recipe, self.steps)
        self.model.train()

    def maybe_resume(self) -> None:
        """Continue from the checkpoint ``train.resume`` names (by default the latest complete
        one), refusing one written with another data order."""
        self.start, self.history = 0, []
        resume_from = checkpoint.find_resume(self.out, self.recipe.train.resume)
        if resume_from is None:
            torch.manual_seed(self.recipe.train.seed + 1000 * self.rank)  # dropout differs across ranks, reproducibly
            return
        meta = checkpoint.load_checkpoint(self.engine, resume_from)
        saved = {k: meta.get("data", {}).get(k) for k in self.data_identity}
        changed = {k: (saved[k], v) for k, v in self.data_identity.items() if saved[k] != v}
        if changed:
            raise ValueError(
                f"train.resume: checkpoint {resume_from} was written with a different data order "
                f"({', '.join(f'{k}: {a} then, {b} now' for k, (a, b) in changed.items())}); "
                "restore those settings, or start afresh with train.resume=never or a new train.output_dir"
            )
        self.start, self.history = meta["step"], meta["history"]
        if self.rank == 0:
            print(f"resumed from {resume_from} at step {self.start}", flush=True)

    def train(self) -> None:
        """Optimizer steps from ``start`` to the end: each logged, every ``save_steps`` a
        checkpoint (not after the last: the adapter follows)."""
        t = self.recipe.train
        self.log = MetricLog(self.out, t.report_to, self.history) if self.rank == 0 else None
        bar = tqdm(total=self.steps, initial=self.start, desc=f"train {self.recipe.name}", disable=self.rank != 0, unit="step")
        for step in range(self.start, self.steps):
            record = self._step(step)
            self.history.append(record)
            if self.log is not None:
                report = (step + 1) % t.log_steps == 0 or step + 1 == self.steps
                self.log.write(record, report)
                if report:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", grad_norm=f"{record['grad_norm']:.3f}")
            bar.update()
            if (step + 1) % t.save_steps == 0 and step + 1 < self.steps:
                self._checkpoint(step + 1)
        bar.close()

    def _step(self, step: int) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; its log record."""
        began = time.perf_counter()
        lr = self.engine.lr()
        accum = self.recipe.train.gradient_accumulation_steps
        losses = []
        for micro in range(step * accum, (step + 1) * accum):
            rows = [self.dataset[i] for i in self.order.indices(micro)]
            batch = {k: torch.stack([r[k] for r in rows]).to(self.device) for k in rows[0]}
            losses.append(self.engine.micro_step(batch))
        grad_norm = self.engine.optimizer_step()
        loss = self.engine.mean(sum(losses) / len(losses))
        seconds = time.perf_counter() - began
        tokens = self.recipe.train.per_device_batch_size * self.recipe.seq_len * accum * self.world
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / seconds, "peak_mem_mib": peak_memory_mib(self.device)}

    def _checkpoint(self, step: int) -> None:
        micro = step * self.recipe.train.gradient_accumulation_steps
        position = {**self.data_identity, "micro_batches": micro, "epoch": micro // self.order.per_epoch}
        meta = {"history": self.history, "recipe": self.recipe.name, "data": position}
        checkpoint.save_checkpoint(self.engine, self.out, step, meta, self.recipe.train.save_total_limit)

    def save(self) -> dict:
        """The probe logits, the adapter and the summary (``train_summary.json``)."""
        write_probe(self.engine, self.dataset[0]["input_ids"][:128], self.device, self.out / "adapter_probe.safetensors")
        adapter_dir = save_adapter(self.engine, self.out / "adapter", self.recipe, self.base, self.tokenizer)
        if self.log is not None:
            self.log.close()
        history = self.history
        summary = {"steps": self.steps, "final_loss": history[-1]["loss"] if history else None, "adapter": str(adapter_dir),
                   "world_size": self.world, "history": history}
        if self.rank == 0:
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=1))
            print(f"adapter saved to {adapter_dir}", flush=True)
        return summary


def train(recipe: Recipe) -> dict:
    """Run ``recipe`` on this process (every rank calls it); returns the summary:
    ``steps``, ``final_loss``, ``adapter``, ``world_size`` and the per-step ``history``."""
    return Trainer(recipe).run()
