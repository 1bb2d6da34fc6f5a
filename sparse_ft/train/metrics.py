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

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                print("report_to lists wandb but it is not installed: skipping W&B", flush=True)
            else:
                self.wandb = wandb.init(project="sparse-ft", dir=str(output_dir), resume="allow")

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key == "step":
                continue
            if self.tensorboard is not None:
                self.tensorboard.add_scalar(f"train/{key}", value, record["step"])
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
