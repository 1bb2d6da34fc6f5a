"""The training recipe as one explicit class (torchtune style): ``Trainer.run`` calls its
stages in order (the attention method, the input checks, processes and the output directory,
data, model, engine, resume, the loop, the adapter), each a short method that a variant can
override (``sparse_ft.train.pretrainer``). Deterministic data order (``data_order``),
accumulation, logging, checkpoints and a bit-identical resume, or one on another number of
processes that continues the epoch where it stood."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from sparse_ft import console
from sparse_ft.config import Recipe, format_recipe, save_resolved, summarize_recipe
from sparse_ft.config.bad_input import one_line
from sparse_ft.data.packing import TokenBlocks, build_train_dataset
from sparse_ft.methods import dense_layer_indices, dense_tail_start
from sparse_ft.modeling.attention import AttentionNotCalled, checked_calls, pretrained
from sparse_ft.modeling.model_io import load_tokenizer, materialize_tiny
from sparse_ft.files.outputs import DISK_FULL, RunLock, write_synced
from sparse_ft.train import checkpoint, run_directory, sequence_parallel, validation
from sparse_ft.train.checkpoint import NonFiniteWeights
from sparse_ft.train.adapter import adapter_meta, save_adapter
from sparse_ft.train.data_order import DataOrder, DataPosition, saved_position
from sparse_ft.train.deepspeed import DeepSpeedEngine, resolve_deepspeed_config
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.engine import Engine
from sparse_ft.train.fingerprint import check_resume, check_resume_data, fingerprint
from sparse_ft.train.metrics import MetricLog, peak_memory_mib
from sparse_ft.train.model_setup import base_model_path, build_model, training_method
from sparse_ft.train.preflight import preflight
from sparse_ft.train.stopping import (Diverged, Preempted, RunStopped, SaveClock, StopSignals, ValidationFailed,
                                       WrongAttention, non_finite, signal_name)
from sparse_ft.modeling.tiny import display_name, is_built_in
from sparse_ft.modeling.weight_files import fingerprint as weights_fingerprint


def write_probe(engine: Engine, input_ids: torch.Tensor, device: torch.device, path: Path) -> None:
    """Logits of the trained model (eval mode, training pattern) on a fixed input, saved
    beside the adapter: reloading the adapter must reproduce them (a ZeRO-3 run that saved
    empty or stale tensors would not)."""
    from safetensors.torch import save

    model = engine.module
    model.eval()
    with torch.no_grad(), engine.autocast():  # collective under ZeRO-3: every rank runs it
        logits = model(input_ids=input_ids[None].to(device)).logits.float().cpu()
    model.train()
    if engine.rank == 0:
        write_synced(path, save({"input_ids": input_ids[None].contiguous(), "logits": logits.contiguous()}))


def total_steps(recipe: Recipe, order: DataOrder, start: DataPosition, done: int) -> int:
    """The run's length in optimizer steps: ``train.max_steps``, or the ``done`` steps taken
    plus what is left of ``train.num_epochs`` from ``start`` with this launch's processes."""
    t = recipe.train
    if t.max_steps > 0:
        return t.max_steps
    steps = done + order.remaining(start, t.num_epochs) // t.gradient_accumulation_steps
    if steps == 0:
        raise ValueError(
            f"one epoch gives {order.per_epoch} micro-batches, fewer than train.gradient_accumulation_steps="
            f"{t.gradient_accumulation_steps}: set train.max_steps or add data"
        )
    return steps


class Trainer:
    """One run of ``recipe``: every rank constructs one and calls :meth:`run`."""

    # SIGTERM / SIGINT finish the step, save a checkpoint and stop (``sparse_ft.train.stopping``)
    stops_on_signals = True
    trains_adapters = True  # LoRA on a frozen base; the Pretrainer trains every weight

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
        loads or is written; the output directory's lock is released however the rest ends,
        a stop signal's way (:class:`Preempted`) included. A full disk in any write of the loop
        or of the end (log, probe, adapter, summary) is a ``CheckpointWriteError``, one line
        saying which checkpoint to resume from, as a checkpoint's own is."""
        with StopSignals(self.stops_on_signals) as self.signals:
            self.setup_method()
            self.preflight()
            try:
                self.setup_distributed()
                self.setup_data()
                self.setup_model()
                self.setup_engine()
                self.maybe_resume()
                self.training = True
                try:
                    self.train()
                    return self.save()
                except OSError as err:  # a full disk in any write of the loop or the end's (the log, the adapter)
                    if isinstance(err, checkpoint.CheckpointWriteError) or err.errno not in DISK_FULL:
                        raise
                    raise checkpoint.write_failed(self.out, Path(err.filename or self.out), err) from err
            finally:
                self.lock.release()

    def setup_method(self) -> None:
        """The attention method the model trains through, built once for the whole run, with
        ``attention.backend: auto`` resolved on this machine (before the recipe is saved)."""
        self.method = training_method(self.recipe)

    def preflight(self) -> None:
        """Every input the run reads, checked before anything loads or is written; the
        validation tasks prepared."""
        self.validation = preflight(self.recipe, self.method)

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
        """Rank 0: claim and lock the directory, refuse what the run would lose there (an
        earlier run's checkpoints and results, links, files not sparse-ft's), pick the
        checkpoint to resume (verified) and check it was written with this recipe, all before
        the tiny base is written. Returns its step, or -1."""
        t = self.recipe.train
        run_directory.take(self.out)
        self.lock.acquire()
        run_directory.claim(self.out, t.resume, t.overwrite_output_dir)
        found = checkpoint.find_resume(self.out, t.resume)
        meta = checkpoint.read_meta(found) if found is not None else None
        if meta is not None:
            check_resume(meta["fingerprint"], self.fingerprint, t.resume_allow_changes, found)
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
        order over this launch's data-parallel groups, where the run starts in it, and the
        run's length in optimizer steps."""
        t = self.recipe.train
        self.tokenizer = load_tokenizer(self.base, self.recipe.model.trust_remote_code)
        if self.rank == 0:
            self.dataset = self.load_dataset()
            if self.dataset.skipped:  # padding-free samples of empty documents only (sparse_ft/data/packing.py)
                print(f"data: skipped {self.dataset.skipped} of {self.dataset.skipped + len(self.dataset)} samples: "
                      "no target in them (only empty documents; data.min_tokens >= 1 keeps those out)",
                      file=sys.stderr, flush=True)
        self.barrier()
        if self.rank != 0:
            self.dataset = self.load_dataset()
        self.data_identity = {"samples": len(self.dataset), "sha256": self.dataset.sha256()}
        self.order = DataOrder(len(self.dataset), t.per_device_batch_size, self.world // t.sequence_parallel_size,
                               seed=t.seed)
        self.start, self.position = self.resume_position()
        self.steps = total_steps(self.recipe, self.order, self.position, self.start)
        self.dense_from = dense_tail_start(t.dense_final_fraction, self.steps)  # the dense tail's first step (0-based)
        if self.rank == 0:  # the run is on: a resume refused until here leaves the directory as it was
            save_resolved(self.recipe, self.out)
            console.say(summarize_recipe(self.recipe, self.steps, len(self.dataset), adapters=self.trains_adapters))
            console.say(format_recipe(self.recipe), console.VERBOSE)

    def resume_position(self) -> tuple[int, DataPosition]:
        """The step and data position the run continues from: the checkpoint's, once its
        training set is this one (before the model loads), or the beginning."""
        if self.resume_from is None:
            return 0, DataPosition()
        meta = checkpoint.read_meta(self.resume_from)
        check_resume_data(meta["data"], self.data_identity, self.recipe.train.resume_allow_changes, self.resume_from)
        return meta["step"], saved_position(meta["data"], meta["fingerprint"], meta["world_size"], self.resume_from)

    def load_dataset(self) -> TokenBlocks:
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
            self.engine: Engine = sequence_parallel.UlyssesEngine.build(self.model, self.recipe, self.steps,
                                                                        ds_config=self.ds_config, mpu=self.mpu)
        elif self.use_deepspeed:
            self.engine = DeepSpeedEngine.build(self.model, self.recipe, self.steps, ds_config=self.ds_config)
        else:
            self.engine = Engine.build(self.model.to(self.device), self.recipe, self.steps)
        self.model.train()

    def maybe_resume(self) -> None:
        """Continue from the checkpoint rank 0 picked (verified, written with this recipe, on
        this training set)."""
        self.history, self.validations = [], []
        restored = False
        if self.resume_from is not None:
            meta = checkpoint.load_checkpoint(self.engine, self.resume_from)
            self.history, restored = meta["history"], self.rank < meta["world_size"]
            self.validations = meta.get("validation", [])
            if self.rank == 0:
                console.say(f"resumed from {self.resume_from} at step {self.start} (epoch {self.position.epoch}, after "
                            f"{self.position.consumed} of its {self.order.size} samples)")
        if not restored:  # dropout differs across ranks, reproducibly (a rank the checkpoint's run lacked starts afresh)
            torch.manual_seed(self.recipe.train.seed + 1000 * self.rank)

    def train(self) -> None:
        """Optimizer steps from ``start`` to the end: each logged, a checkpoint every
        ``save_steps``, every ``save_minutes`` and after the last (a run killed while saving
        the adapter resumes there). After each step the ranks agree whether to stop: a stop
        signal saves a checkpoint first, a non-finite step saves nothing."""
        t = self.recipe.train
        self.log = (MetricLog(self.out, t.report_to, self.history, self.validations, recipe=self.recipe)
                    if self.rank == 0 else None)
        self.batches = self.micro_batches()
        clock = SaveClock(t.save_minutes)
        self.signals.deferred = True
        quiet = self.rank != 0 or not self.progress
        with tqdm(total=self.steps, initial=self.start, desc=console.bar_label(f"train {self.recipe.name}"), disable=quiet,
                  unit="step") as bar:
            for step in range(self.start, self.steps):
                record = self._step(step)
                problem = non_finite(record["loss"], record["grad_norm"], norm_expected=self.engine.non_finite_norm_expected())
                signum, timed, diverged = self.engine.agree([self.signals.received, clock.due(), problem is not None])
                if diverged:
                    self._diverged(step + 1, problem or "a non-finite number on another rank")
                self.history.append(record)
                if self.log is not None:
                    report = (step + 1) % t.log_steps == 0 or step + 1 == self.steps
                    self.log.write(record, report)
                    if report:
                        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", grad_norm=f"{record['grad_norm']:.3f}")
                bar.update()
                if validation.due(self.recipe, step + 1, self.steps) and not signum:  # a stop saves first
                    self._validate(step + 1, bar)
                if (step + 1) % t.save_steps == 0 or step + 1 == self.steps or signum or timed:
                    self._checkpoint(step + 1)
                    clock.restart()
                if signum:
                    self._stop(Preempted(f"preempted by {signal_name(signum)} at step {step + 1}: saved "
                                         f"{checkpoint.directory(self.out, step + 1).name}; resume with the same command",
                                         signum, announce=self.rank == 0))

    def _validate(self, step: int, bar: tqdm) -> None:
        """The validation tasks after ``step``, on every rank (under ZeRO-3 each forward
        gathers parameters from all of them); rank 0 logs and says them. Before the step's
        checkpoint, which keeps them for a resume's log. A task that fails saves that
        checkpoint and stops the run in one line (:class:`ValidationFailed`): the steps trained
        since the last one are not lost to it."""
        try:
            records = self.validation.run(self.engine.module, self.engine.autocast(), step)
        except Exception as err:  # noqa: BLE001 - whatever a task raised, the trained steps are saved first
            self._checkpoint(step)
            self._stop(ValidationFailed(f"validation after step {step} failed ({type(err).__name__}: {one_line(err)}); "
                                        f"saved {checkpoint.directory(self.out, step).name}: correct the recipe's "
                                        "validation keys and resume with the same command", announce=self.rank == 0))
        for record in records:
            self.validations.append(record)
            if self.log is not None:
                self.log.write_validation(record)
                said = ", ".join(f"{key}={value:.4g}" for key, value in record["metrics"].items())
                bar.write(f"step {step}: {said} ({record['seconds']:.1f} s)")

    def _stop(self, reason: RunStopped) -> None:
        """End the loop on every rank together (after their last writes), the log closed."""
        if self.log is not None:
            self.log.close()
        self.engine.barrier()
        raise reason

    def _diverged(self, step: int, problem: str) -> None:
        """Stop without saving: the newest checkpoint is the last one of finite numbers."""
        steps = checkpoint.complete_checkpoints(self.out)
        kept = f"kept {checkpoint.directory(self.out, steps[-1])} (the last good one)" if steps else "no checkpoint was written yet"
        self._stop(Diverged(f"step {step}: {problem}: training diverged; {kept}, saved no adapter; "
                            "lower train.lr or look at the data", announce=self.rank == 0))

    def _batch(self, micro: int) -> dict:
        """This rank's ``micro``-th batch since the run started or resumed, on the CPU: its
        group's share of that micro-batch, or under sequence parallelism (an SP group takes its
        ranks' batches in turn) of micro-batch ``micro × sp + its turn``."""
        group, turn = divmod(self.rank, self.recipe.train.sequence_parallel_size)
        at = self.order.advance(self.position, micro * self.recipe.train.sequence_parallel_size + turn)
        rows = [self.dataset[i] for i in self.order.indices(at, group)]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def micro_batches(self) -> Iterator[dict]:
        """The micro-batches this rank trains on from where the run starts: its own, or under
        sequence parallelism its shard of its SP group's."""
        if self.mpu is not None:
            return sequence_parallel.shard_batches(self._batch, self.device)
        return ({k: v.to(self.device) for k, v in self._batch(m).items()} for m in itertools.count())

    def _micro_step(self, *, checked: bool) -> float:
        """The next micro-batch's forward and backward; its loss. The launch's first (``checked``)
        counts that every attention layer called the method the recipe installed, and stops
        the run in one line otherwise: a library that picks its own attention would have
        trained another kernel with no error."""
        if not checked:
            return self.engine.micro_step(next(self.batches))
        try:
            with checked_calls(self.engine.module, when=f"step {self.start + 1}"):
                return self.engine.micro_step(next(self.batches))
        except AttentionNotCalled as err:
            self._stop(WrongAttention(f"{err}; nothing of this step was saved", announce=self.rank == 0))

    def _dense_tail(self, step: int) -> None:
        """From the dense tail's first step on (``train.dense_final_fraction``), every layer
        attends fully: a run resumed past it switches before its first step."""
        if step >= self.dense_from and not self.method.everywhere:
            self.method.everywhere = True
            if self.rank == 0:
                console.say(f"step {step + 1}: full attention in every layer to the end (train.dense_final_fraction="
                            f"{self.recipe.train.dense_final_fraction:g})")

    def _step(self, step: int) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; its log record."""
        self._dense_tail(step)
        began = time.perf_counter()
        lr = self.engine.lr()
        accum = self.recipe.train.gradient_accumulation_steps
        losses = [self._micro_step(checked=step == self.start and micro == 0) for micro in range(accum)]
        grad_norm = self.engine.optimizer_step()
        loss = self.engine.mean(sum(losses) / len(losses))
        seconds = time.perf_counter() - began
        data_parallel = self.world // self.recipe.train.sequence_parallel_size
        tokens = self.recipe.train.per_device_batch_size * self.recipe.seq_len * accum * data_parallel
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / seconds, "peak_mem_mib": peak_memory_mib(self.device)}

    def _checkpoint(self, step: int) -> None:
        """Checkpoint ``step`` with the data position it reached: the training set it ran on
        and how much of the epoch's order it consumed."""
        accum = self.recipe.train.gradient_accumulation_steps
        position = self.order.advance(self.position, (step - self.start) * accum)
        data = {**self.data_identity, "micro_batches": step * accum, **position.to_json()}
        meta = {"history": self.history, "validation": self.validations, "recipe": self.recipe.name, "data": data,
                "fingerprint": self.fingerprint}
        try:
            checkpoint.save_checkpoint(self.engine, self.out, step, meta, keep=self.recipe.train.save_total_limit,
                                       adapter=self.adapter_meta())
        except NonFiniteWeights as err:
            self._diverged(step, f"its update left {err}")

    def adapter_meta(self) -> Optional[dict]:
        """The ``sparse_ft.json`` of the adapter the run saves, and every checkpoint holds."""
        return adapter_meta(self.engine.module, self.recipe, self.base, self.base_fingerprint)

    def save(self) -> dict:
        """The probe logits, the adapter and the summary."""
        write_probe(self.engine, self.dataset[0]["input_ids"][:128], self.device, self.out / run_directory.PROBE)
        adapter_dir = save_adapter(self.engine, self.out / run_directory.ADAPTER, self.adapter_meta(), tokenizer=self.tokenizer)
        summary = self.summary({"adapter": str(adapter_dir)})
        if self.rank == 0:
            console.say(f"adapter saved to {adapter_dir}")
        return summary

    def full_attention(self) -> dict:
        """Where the run attended fully: the layers of ``attention.dense_layers`` (indices) and
        the first (1-based) step of the dense tail (``train.dense_final_fraction``; None: none)."""
        layers = pretrained(self.engine.module).config.num_hidden_layers
        return {"layers": dense_layer_indices(self.recipe.attention.dense_layers, layers),
                "every_layer_from_step": self.dense_from + 1 if self.dense_from < self.steps else None}

    def summary(self, saved: dict) -> dict:
        """The run's summary, with what it ``saved``, also written as ``train_summary.json``;
        the metric log is closed."""
        if self.log is not None:
            self.log.close()
        history = self.history
        summary = {"model": display_name(self.recipe.model.name_or_path), "steps": self.steps,
                   "final_loss": history[-1]["loss"] if history else None, **saved, "full_attention": self.full_attention(),
                   "world_size": self.world, "history": history, "validation": self.validations}
        if self.rank == 0:
            (self.out / run_directory.SUMMARY).write_text(json.dumps(summary, indent=1))
        return summary


def train(recipe: Recipe) -> dict:
    """Run ``recipe`` on this process (every rank calls it); returns the summary:
    ``steps``, ``final_loss``, ``adapter``, ``world_size`` and the per-step ``history``."""
    return Trainer(recipe).run()
