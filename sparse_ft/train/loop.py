"""The training loop: deterministic data order, accumulation, logging, checkpoints, resume."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from sparse_ft.config import Recipe, format_recipe, resolve_deepspeed_config, save_resolved
from sparse_ft.data.packing import build_train_dataset
from sparse_ft.train import checkpoint
from sparse_ft.train.adapter import save_adapter
from sparse_ft.train.distributed import init_distributed
from sparse_ft.train.engine import DeepSpeedEngine, Engine
from sparse_ft.train.metrics import MetricLog, peak_memory_mib
from sparse_ft.train.model_setup import base_model_path, build_model, load_tokenizer, materialize_tiny


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


def train(recipe: Recipe) -> dict:
    use_ds = recipe.deepspeed is not None
    rank, world = init_distributed(use_ds)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    out = Path(recipe.train.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved(recipe, out)
        print(f"recipe {recipe.name}:\n{format_recipe(recipe)}", flush=True)
        if recipe.model.name_or_path == "tiny":
            materialize_tiny(out / "base-model", recipe.train.seed, **recipe.model.tiny)
    barrier()
    base = base_model_path(recipe)
    tokenizer = load_tokenizer(base, recipe.model.trust_remote_code)
    build = lambda: build_train_dataset(recipe.data, tokenizer, recipe.seq_len, recipe.model.trust_remote_code)  # noqa: E731
    if rank == 0:  # rank 0 tokenizes; the others then read its cache
        dataset = build()
    barrier()
    if rank != 0:
        dataset = build()
    order = DataOrder(len(dataset), recipe.train.per_device_batch_size, world, rank, recipe.train.seed)
    steps = total_steps(recipe, order)

    torch.manual_seed(recipe.train.seed)  # identical LoRA initialisation on every rank
    ds_config = resolve_deepspeed_config(recipe, world, torch.cuda.is_available()) if use_ds else None
    model = build_model(recipe, base, ds_config)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if use_ds:
        engine: Engine = DeepSpeedEngine(model, recipe, steps, ds_config)
    else:
        engine = Engine(model.to(device), recipe, steps)
    model.train()

    start, history = 0, []
    resume_from = checkpoint.find_resume(out, recipe.train.resume)
    # what fixes the data order: a resume with any of it changed would not see the same batches
    data_identity = {"samples": len(dataset), "seq_len": recipe.seq_len, "seed": recipe.train.seed,
                     "per_device_batch_size": recipe.train.per_device_batch_size,
                     "gradient_accumulation_steps": recipe.train.gradient_accumulation_steps}
    if resume_from is not None:
        meta = checkpoint.load_checkpoint(engine, resume_from)
        saved = {k: meta.get("data", {}).get(k) for k in data_identity}
        changed = {k: (saved[k], v) for k, v in data_identity.items() if saved[k] != v}
        if changed:
            raise ValueError(
                f"train.resume: checkpoint {resume_from} was written with a different data order "
                f"({', '.join(f'{k}: {a} then, {b} now' for k, (a, b) in changed.items())}); "
                "restore those settings, or start afresh with train.resume=never or a new train.output_dir"
            )
        start, history = meta["step"], meta["history"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {start}", flush=True)
    else:
        torch.manual_seed(recipe.train.seed + 1000 * rank)  # dropout differs across ranks, reproducibly

    log = MetricLog(out, recipe.train.report_to, history) if rank == 0 else None
    bar = tqdm(total=steps, initial=start, desc=f"train {recipe.name}", disable=rank != 0, unit="step")
    accum, tokens_per_micro = recipe.train.gradient_accumulation_steps, recipe.train.per_device_batch_size * recipe.seq_len
    for step in range(start, steps):
        began = time.perf_counter()
        lr = engine.lr()
        losses = []
        for micro in range(step * accum, (step + 1) * accum):
            rows = [dataset[i] for i in order.indices(micro)]
            batch = {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}
            losses.append(engine.micro_step(batch))
        grad_norm = engine.optimizer_step()
        loss = engine.mean(sum(losses) / len(losses))
        seconds = time.perf_counter() - began
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_micro * accum * world / seconds, "peak_mem_mib": peak_memory_mib(device)}
        history.append(record)
        if log is not None:
            report = (step + 1) % recipe.train.log_steps == 0 or step + 1 == steps
            log.write(record, report)
            if report:
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", grad_norm=f"{grad_norm:.3f}")
        bar.update()
        if (step + 1) % recipe.train.save_steps == 0 and step + 1 < steps:
            micro = (step + 1) * accum
            position = {**data_identity, "micro_batches": micro, "epoch": micro // order.per_epoch}
            checkpoint.save_checkpoint(engine, out, step + 1, {"history": history, "recipe": recipe.name, "data": position},
                                       recipe.train.save_total_limit)
    bar.close()
    write_probe(engine, dataset[0]["input_ids"][:128], device, out / "adapter_probe.safetensors")
    adapter_dir = save_adapter(engine, out / "adapter", recipe, base, tokenizer)
    if log is not None:
        log.close()
    summary = {"steps": steps, "final_loss": history[-1]["loss"] if history else None, "adapter": str(adapter_dir),
               "world_size": world, "history": history}
    if rank == 0:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
        print(f"adapter saved to {adapter_dir}", flush=True)
    return summary
