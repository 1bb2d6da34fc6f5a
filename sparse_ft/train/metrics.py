"""Per-step metrics to a JSONL file (always), TensorBoard and W&B (when asked and installed).

A resumed run continues its W&B run: the run id is kept in the output directory
(``WANDB_ID_FILE``) and handed back to ``wandb.init`` with ``resume="allow"``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WANDB_ID_FILE = "wandb_run_id"
LOG_FILE = "log.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # where wandb.init(dir=output_dir) puts its files


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


def _wandb_run(wandb, output_dir: Path, resumed: bool):
    """The W&B run: a resumed training run continues the one it started, a fresh one starts
    its own and records its id."""
    id_file = output_dir / WANDB_ID_FILE
    if resumed and id_file.is_file():
        return wandb.init(project="sparse-ft", dir=str(output_dir), id=id_file.read_text().strip(), resume="allow")
    run = wandb.init(project="sparse-ft", dir=str(output_dir))
    id_file.write_text(run.id + "\n")
    return run


class MetricLog:
    def __init__(self, output_dir: Path, report_to: list[str], history: list[dict], validations: list[dict] = ()) -> None:
        self.path = output_dir / LOG_FILE
        # a resumed run rewrites the log from the checkpoint: steps after it were never kept;
        # a step's validation lines (``kind``) follow its training line
        lines = sorted([*history, *validations], key=lambda r: (r["step"], "kind" in r))
        self.path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        self.tensorboard = self.wandb = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops the events written after the checkpoint resumed from (by a killed
            # run, or, when starting afresh, by an earlier run whose checkpoints were overwritten)
            self.tensorboard = SummaryWriter(str(output_dir / TENSORBOARD_DIR), purge_step=len(history) + 1)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                print("report_to lists wandb but it is not installed: skipping W&B", flush=True)
            else:
                self.wandb = _wandb_run(wandb, output_dir, resumed=bool(history))

    def write(self, record: dict, report: bool = True) -> None:
        """Every step goes to the JSONL file (the full loss curve); ``report`` also sends it to
        TensorBoard / W&B (the recipe's log steps)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if report:
            self._report({f"train/{k}": v for k, v in record.items() if k != "step"}, record["step"])

    def write_validation(self, record: dict) -> None:
        """A validation record (``kind``, ``step``, ``metrics`` named ``val/...``): a line in
        the JSONL file, its metrics to every tracker at its step."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._report(record["metrics"], record["step"])

    def _report(self, scalars: dict, step: int) -> None:
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
