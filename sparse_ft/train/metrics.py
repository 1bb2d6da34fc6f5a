"""Per-step metrics to a JSONL file (always), TensorBoard and W&B (when asked and installed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class MetricLog:
    def __init__(self, output_dir: Path, report_to: list[str], history: list[dict]) -> None:
        self.path = output_dir / "log.jsonl"
        # a resumed run rewrites the log from the checkpoint: steps after it were never kept
        self.path.write_text("".join(json.dumps(r) + "\n" for r in history))
        self.tensorboard = self.wandb = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops the events written after the checkpoint resumed from (by a killed
            # run, or, when starting afresh, by an earlier run whose checkpoints were overwritten)
            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"), purge_step=len(history) + 1)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                print("report_to lists wandb but it is not installed: skipping W&B", flush=True)
            else:
                self.wandb = wandb.init(project="sparse-ft", dir=str(output_dir), resume="allow")

    def write(self, record: dict, report: bool = True) -> None:
        """Every step goes to the JSONL file (the full loss curve); ``report`` also sends it to
        TensorBoard / W&B (the recipe's log steps)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if not report:
            return
        scalars = {f"train/{k}": v for k, v in record.items() if k != "step"}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
