"""The training recipe as one explicit class (torchtune style): ``Trainer.run`` calls its
stages in order (the attention method, the input checks, processes and the output directory,
data, model, engine, resume, the loop, the adapter), each a short method that a variant can
override (``sparse_ft.train.pretrainer``). Deterministic data order, accumulation, logging,
checkpoints and a bit-identical resume."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from sparse_ft.config import Recipe, format_recipe, save_resolved
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.modeling.model_io import load_tokenizer, materialize_tiny
from sparse_ft.files.outputs import RunLock
from sparse_ft.train import checkpoint, sequence_parallel
from sparse_ft.train.checkpoint import claim_checkpoints
from sparse_ft.train.adapter import save_adapter
from sparse_ft.train.deepspeed import DeepSpeedEngine, resolve_deepspeed_config
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.engine import Engine
from sparse_ft.train.fingerprint import check_resume, fingerprint
from sparse_ft.train.metrics import MetricLog, peak_memory_mib
from sparse_ft.train.model_setup import base_model_path, build_model, training_method
from sparse_ft.train.preflight import preflight
from sparse_ft.modeling.tiny import is_built_in
from sparse_ft.modeling.weight_files import fingerprint as weights_fingerprint


class DataOrder:
    """Micro-batch ``m`` of rank ``r``: a fixed slice of epoch ``m // per_epoch``'s seeded
    permutation. Position alone determines the batch, so a resume skips nothing and repeats
    nothing."""

    def __init__(self, size: int, batch: int, world: int, rank: int, *, seed: int) -> None:
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
    with torch.no_grad(), engine.autocast():  # collective under ZeRO-3: every rank runs it
        logits = model(input_ids=input_ids[None].to(device)).logits.float().cpu()
    model.train()
    if engine.rank == 0:
        save_file({"input_ids": input_ids[None].contiguous(), "logits": logits.contiguous()}, str(path))


def micro_per_epoch(recipe: Recipe, order: DataOrder) -> int:
    """Micro-steps in an epoch: each rank's batches, or under sequence parallelism its SP
    group's, which take their ranks' batches in turn."""
    return order.per_epoch * recipe.train.sequence_parallel_size


def total_steps(recipe: Recipe, order: DataOrder) -> int:
    if recipe.train.max_steps > 0:
        return recipe.train.max_steps
    per_epoch = micro_per_epoch(recipe, order)
    steps = recipe.train.num_epochs * per_epoch // recipe.train.gradient_accumulation_steps
    if steps == 0:
        raise ValueError(
            f"one epoch gives {per_epoch} micro-batches, fewer than train.gradient_accumulation_steps="
            f"{recipe.train.gradient_accumulation_steps}: set train.max_steps or add data"
        )
    return steps


class Trainer:
    """One run of ``recipe``: every rank constructs one and calls :meth:`run`."""

    def __init__(self, recipe: Recipe, progress: bool = True) -> None:
        self.recipe = recipe
        self.progress = progress  # rank 0's progress bar
        self.out = Path(recipe.train.output_dir)
        self.base = base_model_path(recipe)  # where the tiny model is written first, when the recipe names it
        self.use_deepspeed = recipe.deepspeed is not None
        self.lock = RunLock(self.out)
        # False until the loop starts: an error before it is the recipe's or the directory's (train.py prints one line)
        self.training = False

    def run(self) -> dict:
        """Train to the end (resuming where a checkpoint allows) and save the adapter; returns
        the run's summary. Every bad input fails in preflight, in one line, before anything
        loads or is written; the output directory's lock is released however the rest ends."""
        self.setup_method()
        self.preflight()
        try:
            self.setup_distributed()
            self.setup_data()
            self.setup_model()
            self.setup_engine()
            self.maybe_resume()
            self.training = True
            self.train()
            return self.save()
        finally:
            self.lock.release()

    def setup_method(self) -> None:
        """The attention method the model trains through, built once for the whole run, with
        ``attention.backend: auto`` resolved on this machine (before the recipe is saved)."""
        self.method = training_method(self.recipe)

    def preflight(self) -> None:
        """Every input the run reads, checked before anything loads or is written."""
        preflight(self.recipe, self.method)

    def setup_distributed(self) -> None:
        """Join the process group; rank 0 takes the output directory while the others wait for
        its verdict and the checkpoint to resume."""
        self.rank, self.world = init_distributed(self.use_deepspeed)
        self.barrier = dist.barrier if dist.is_initialized() else (lambda: None)
        self.fingerprint = fingerprint(self.recipe, self.world)
        resume = self.recipe.train.resume
        step = self._decided_by_rank0(self._take_output_dir)
        self.resume_from = None if step < 0 else Path(resume) if resume != "auto" else checkpoint.directory(self.out, step)

    def _take_output_dir(self) -> int:
        """Rank 0: lock the directory, keep a fresh run from an earlier run's checkpoints, pick
        the checkpoint to resume (verified) and check it was written with this recipe, all
        before the resolved recipe and the tiny base are written. Returns its step, or -1."""
        t = self.recipe.train
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        claim_checkpoints(self.out, t.resume, t.overwrite_output_dir)
        found = checkpoint.find_resume(self.out, t.resume)
        meta = checkpoint.read_meta(found) if found is not None else None
        if meta is not None:
            check_resume(meta["fingerprint"], self.fingerprint, t.resume_allow_changes, found)
        save_resolved(self.recipe, self.out)
        print(f"recipe {self.recipe.name}:\n{format_recipe(self.recipe)}", flush=True)
        if is_built_in(self.recipe.model.name_or_path):
            materialize_tiny(Path(self.base), t.seed, **self.recipe.model.tiny)
        return meta["step"] if meta is not None else -1

    def _decided_by_rank0(self, decide: Callable[[], int]) -> int:
        """``decide()`` on rank 0, its result on every rank. If it raises, the others stop too,
        rather than wait at a barrier for a rank that is gone."""
        if not dist.is_initialized():
            return decide()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        value = torch.tensor([-2], dtype=torch.int64, device=device)  # -2: rank 0 failed
        try:
            if self.rank == 0:
                value[0] = decide()
        finally:
            dist.broadcast(value, src=0)
        if value.item() == -2:
            raise ValueError(f"rank 0 could not start the run in train.output_dir={self.out} (its error says why)")
        return int(value.item())

    def setup_data(self) -> None:
        """The packed training set (rank 0 tokenizes, the others then read its cache), its
        per-rank order, and the run's length in optimizer steps."""
        recipe = self.recipe
        self.tokenizer = load_tokenizer(self.base, recipe.model.trust_remote_code)
        if self.rank == 0:
            self.dataset = self.load_dataset()
        self.barrier()
        if self.rank != 0:
            self.dataset = self.load_dataset()
        self.order = DataOrder(len(self.dataset), recipe.train.per_device_batch_size, self.world, self.rank,
                               seed=recipe.train.seed)
        self.steps = total_steps(recipe, self.order)

    def load_dataset(self) -> torch.utils.data.Dataset:
        """The recipe's documents, tokenised and packed into ``seq_len`` samples through a cache
        (rank 0 writes it, the others then read it)."""
        r = self.recipe
        return build_train_dataset(r.data, self.tokenizer, r.seq_len, r.model.trust_remote_code)

    def setup_model(self) -> None:
        """Base model, position interpolation, LoRA+ and the training pattern; under ZeRO-3
        the weights load partitioned."""
        torch.manual_seed(self.recipe.train.seed)  # identical LoRA initialisation on every rank
        on_cuda = torch.cuda.is_available()
        self.ds_config = resolve_deepspeed_config(self.recipe, self.world, on_cuda) if self.use_deepspeed else None
        self.model = self.build_model()
        # read from the files the base loaded from (so the same under ZeRO-3 or NF4): the adapter records it
        self.base_fingerprint = weights_fingerprint(self.base) if self.rank == 0 else None
        self.mpu = sequence_parallel.register(self.model, self.recipe) if self.recipe.train.sequence_parallel_size > 1 else None
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")

    def build_model(self) -> torch.nn.Module:
        """The base with position interpolation, LoRA+ and the training method."""
        return build_model(self.recipe, self.base, self.method, self.ds_config)

    def setup_engine(self) -> None:
        """The optimizer and schedule, through DeepSpeed when the recipe names a config."""
        if self.mpu is not None:
            self.engine: Engine = sequence_parallel.UlyssesEngine(self.model, self.recipe, self.steps, self.ds_config,
                                                                  mpu=self.mpu)
        elif self.use_deepspeed:
            self.engine = DeepSpeedEngine(self.model, self.recipe, self.steps, self.ds_config)
        else:
            self.engine = Engine(self.model.to(self.device), self.recipe, self.steps)
        self.model.train()

    def maybe_resume(self) -> None:
        """Continue from the checkpoint rank 0 picked (verified, written with this recipe),
        refusing one whose training set had another size: the data changed under the recipe."""
        self.start, self.history = 0, []
        if self.resume_from is None:
            torch.manual_seed(self.recipe.train.seed + 1000 * self.rank)  # dropout differs across ranks, reproducibly
            return
        meta = checkpoint.load_checkpoint(self.engine, self.resume_from)
        data_allowed = any(key.startswith(("data.", "model.")) for key in self.recipe.train.resume_allow_changes)
        if meta["data"]["samples"] != len(self.dataset) and not data_allowed:
            raise ValueError(
                f"train.resume: {self.resume_from} was written when the training set had {meta['data']['samples']} samples, "
                f"it has {len(self.dataset)} now (data.source changed): the data order would differ; "
                "restore the data, or start afresh in a new train.output_dir"
            )
        self.start, self.history = meta["step"], meta["history"]
        if self.rank == 0:
            print(f"resumed from {self.resume_from} at step {self.start}", flush=True)

    def train(self) -> None:
        """Optimizer steps from ``start`` to the end: each logged, a checkpoint every
        ``save_steps`` and after the last (a run killed while saving the adapter resumes there)."""
        t = self.recipe.train
        self.log = MetricLog(self.out, t.report_to, self.history) if self.rank == 0 else None
        self.batches = self.micro_batches(self.start * t.gradient_accumulation_steps)
        quiet = self.rank != 0 or not self.progress
        with tqdm(total=self.steps, initial=self.start, desc=f"train {self.recipe.name}", disable=quiet, unit="step") as bar:
            for step in range(self.start, self.steps):
                record = self._step(step)
                self.history.append(record)
                if self.log is not None:
                    report = (step + 1) % t.log_steps == 0 or step + 1 == self.steps
                    self.log.write(record, report)
                    if report:
                        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", grad_norm=f"{record['grad_norm']:.3f}")
                bar.update()
                if (step + 1) % t.save_steps == 0 or step + 1 == self.steps:
                    self._checkpoint(step + 1)

    def _batch(self, micro: int) -> dict:
        """This rank's micro-batch ``micro``, on the CPU."""
        rows = [self.dataset[i] for i in self.order.indices(micro)]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def micro_batches(self, first: int) -> Iterator[dict]:
        """The micro-batches this rank trains on from micro-batch ``first`` on: its own, or
        under sequence parallelism its shard of its SP group's."""
        if self.mpu is not None:
            return sequence_parallel.shard_batches(self._batch, first, self.device)
        return ({k: v.to(self.device) for k, v in self._batch(m).items()} for m in itertools.count(first))

    def _step(self, step: int) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; its log record."""
        began = time.perf_counter()
        lr = self.engine.lr()
        accum = self.recipe.train.gradient_accumulation_steps
        losses = [self.engine.micro_step(next(self.batches)) for _ in range(accum)]
        grad_norm = self.engine.optimizer_step()
        loss = self.engine.mean(sum(losses) / len(losses))
        seconds = time.perf_counter() - began
        data_parallel = self.world // self.recipe.train.sequence_parallel_size
        tokens = self.recipe.train.per_device_batch_size * self.recipe.seq_len * accum * data_parallel
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / seconds, "peak_mem_mib": peak_memory_mib(self.device)}

    def _checkpoint(self, step: int) -> None:
        micro = step * self.recipe.train.gradient_accumulation_steps
        position = {"samples": len(self.dataset), "micro_batches": micro, "epoch": micro // micro_per_epoch(self.recipe, self.order)}
        meta = {"history": self.history, "recipe": self.recipe.name, "data": position, "fingerprint": self.fingerprint}
        checkpoint.save_checkpoint(self.engine, self.out, step, meta, keep=self.recipe.train.save_total_limit)

    def save(self) -> dict:
        """The probe logits, the adapter and the summary."""
        write_probe(self.engine, self.dataset[0]["input_ids"][:128], self.device, self.out / "adapter_probe.safetensors")
        adapter_dir = save_adapter(self.engine, self.out / "adapter", self.recipe, self.base, tokenizer=self.tokenizer,
                                   base_fingerprint=self.base_fingerprint)
        summary = self.summary({"adapter": str(adapter_dir)})
        if self.rank == 0:
            print(f"adapter saved to {adapter_dir}", flush=True)
        return summary

    def summary(self, saved: dict) -> dict:
        """The run's summary, with what it ``saved``, also written as ``train_summary.json``;
        the metric log is closed."""
        if self.log is not None:
            self.log.close()
        history = self.history
        summary = {"steps": self.steps, "final_loss": history[-1]["loss"] if history else None, **saved,
                   "world_size": self.world, "history": history}
        if self.rank == 0:
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def train(recipe: Recipe) -> dict:
    """Run ``recipe`` on this process (every rank calls it); returns the summary:
    ``steps``, ``final_loss``, ``adapter``, ``world_size`` and the per-step ``history``."""
    return Trainer(recipe).run()
