"""Per-step metrics to a JSONL file (always), TensorBoard and W&B (when asked; preflight
refuses a tracker that is not installed).

A resumed run continues its W&B run: the run id is kept in the output directory
(``WANDB_ID_FILE``) and handed back to ``wandb.init`` with ``resume="allow"``. W&B's project,
entity, name, group and tags come from the recipe's ``train.wandb``, else from their usual
environment variables (``WANDB_ENVIRONMENT``), as ``wandb.init``'s own arguments win over its
environment; TensorBoard writes to ``TENSORBOARD_LOGGING_DIR`` when set (as transformers'
Trainer), else to ``output_dir/tensorboard``; preflight checks that directory as it checks
``train.output_dir`` (``check_tensorboard_dir``). Both get the resolved recipe as the run's
configuration. TensorBoard writes from a thread of its own; a full disk there ends the run in
the one line any other write of the run gives (``WriterThreadFailure``)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from sparse_ft.config import Recipe, format_recipe
from sparse_ft.config.bad_input import BadInput, fail
from sparse_ft.files.outputs import DISK_FULL, file_in_the_way

WANDB_ID_FILE = "wandb_run_id"
LOG_FILE = "log.jsonl"
TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_VARIABLE = "TENSORBOARD_LOGGING_DIR"  # transformers' Trainer reads it too
WANDB_DIR = "wandb"  # where wandb.init(dir=output_dir) puts its files
WANDB_PROJECT = "sparse-ft"  # when neither train.wandb.project nor WANDB_PROJECT names one
# train.wandb's keys and the variables they default to (W&B's own names)
WANDB_ENVIRONMENT = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "name": "WANDB_NAME",
                     "group": "WANDB_RUN_GROUP", "tags": "WANDB_TAGS"}
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}  # module, pip name


def check_trackers(report_to: list[str]) -> None:
    """Every tracker ``train.report_to`` asks for is installed: checked in preflight, before
    anything loads, rather than found missing (or skipped) once the run has started."""
    for tracker in report_to:
        if tracker in TRACKER_MODULES and importlib.util.find_spec(TRACKER_MODULES[tracker][0]) is None:
            fail("train.report_to", report_to, f"{tracker} is not installed here; pip install {TRACKER_MODULES[tracker][1]}, "
                 f"or remove {tracker} from train.report_to")


def tensorboard_dir(output_dir: Path) -> tuple[str, Path]:
    """Where TensorBoard writes, and the setting that says so: ``TENSORBOARD_LOGGING_DIR`` when
    set, else ``train.output_dir`` (its ``tensorboard`` folder)."""
    given = os.environ.get(TENSORBOARD_VARIABLE)
    if given:
        return f"{TENSORBOARD_VARIABLE}={given}", Path(given).expanduser()
    return f"train.output_dir={output_dir}", output_dir / TENSORBOARD_DIR


def check_tensorboard_dir(report_to: list[str], output_dir: Path) -> None:
    """TensorBoard's directory can be made and written, checked in preflight like
    ``train.output_dir``: otherwise the writer fails when the loop starts, after the model
    loaded. Nothing is created here."""
    if "tensorboard" not in report_to:
        return
    setting, path = tensorboard_dir(output_dir)
    blocking = file_in_the_way(path)
    existing = next(p for p in (path, *path.parents) if p.exists())  # a relative path ends in ".", which exists
    if blocking is not None:
        why = f"{blocking} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable here"
    else:
        return
    remedy = (f"name a writable directory, or unset {TENSORBOARD_VARIABLE} (then train.output_dir/{TENSORBOARD_DIR})"
              if setting.startswith(TENSORBOARD_VARIABLE) else "choose another train.output_dir, or train.report_to=[none]")
    raise BadInput(f"{setting}: TensorBoard's directory {path} (train.report_to has tensorboard) cannot be made: {why}; {remedy}")


def wandb_settings(recipe: Recipe) -> dict:
    """``wandb.init``'s project, entity, name, group and tags: the recipe's, else the
    environment's, else the project ``sparse-ft`` and W&B's defaults."""
    settings = {key: recipe.train.wandb.get(key, os.environ.get(variable)) for key, variable in WANDB_ENVIRONMENT.items()}
    if isinstance(settings["tags"], str):  # WANDB_TAGS is comma-separated
        settings["tags"] = [tag for tag in settings["tags"].split(",") if tag]
    settings["project"] = settings["project"] or WANDB_PROJECT
    return {key: value for key, value in settings.items() if value}


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


def _wandb_run(wandb, output_dir: Path, resumed: bool, recipe: Optional[Recipe]):
    """The W&B run, with the resolved recipe as its config: a resumed training run continues
    the one it started, a fresh one starts its own and records its id."""
    id_file = output_dir / WANDB_ID_FILE
    settings = wandb_settings(recipe) if recipe is not None else {"project": WANDB_PROJECT}
    config = recipe.to_dict() if recipe is not None else None
    if resumed and id_file.is_file():
        return wandb.init(**settings, dir=str(output_dir), config=config, id=id_file.read_text().strip(), resume="allow")
    run = wandb.init(**settings, dir=str(output_dir), config=config)
    id_file.write_text(run.id + "\n")
    return run


class WriterThreadFailure:
    """``threading.excepthook`` while TensorBoard's writer runs, for the threads it started.

    TensorBoard writes events from its own thread: a full disk there printed that thread's
    traceback (``Exception in thread ...``) before the run's one-line error. This hook takes a
    full disk (``DISK_FULL``) in those threads only, keeps it for :meth:`check` (every step's
    log line calls it, so the loop stops at the next step in the one line a full disk gives
    anywhere else), and hands every other exception, in any thread, to the hook it replaced.
    A hook rather than a flush after each log: a flush makes the main thread wait for the
    writer but leaves the thread's own traceback, which only a hook keeps off the console."""

    def __init__(self, threads: set[threading.Thread], path: Path) -> None:
        self.threads, self.path = threads, path
        self.error: Optional[OSError] = None
        self.replaced = threading.excepthook
        threading.excepthook = self

    def __call__(self, args) -> None:
        if args.thread in self.threads and isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_FULL:
            self.error = args.exc_value
        else:
            self.replaced(args)

    def check(self) -> None:
        """The writer's full disk, as an ``OSError`` naming TensorBoard's directory."""
        if self.error is not None:
            raise self.named(self.error) from self.error

    def named(self, err: OSError) -> OSError:
        return OSError(err.errno, err.strerror or str(err), str(self.path))

    def remove(self) -> None:
        if threading.excepthook is self:
            threading.excepthook = self.replaced


def _tensorboard(output_dir: Path, resumed_at: int, recipe: Optional[Recipe]):
    """The TensorBoard writer, the resolved recipe in its text tab and its scalars as the run's
    hyperparameters, and the hook that takes a full disk in its thread."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    path = tensorboard_dir(output_dir)[1]
    before = set(threading.enumerate())
    # purge_step drops the events written after the checkpoint resumed from (by a killed
    # run, or, when starting afresh, by an earlier run whose checkpoints were overwritten)
    writer = SummaryWriter(str(path), purge_step=resumed_at + 1)
    failure = WriterThreadFailure(set(threading.enumerate()) - before, path)  # the writer's thread starts with it
    if recipe is not None:
        writer.add_text("recipe", "```yaml\n" + format_recipe(recipe) + "```")
        flat = {}
        for section, values in recipe.to_dict().items():
            for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
                flat[f"{section}.{key}".rstrip(".")] = value if isinstance(value, (int, float, str, bool)) else str(value)
        for summary in hparams(flat, {}):
            writer.file_writer.add_summary(summary)
    return writer, failure


class MetricLog:
    def __init__(self, output_dir: Path, report_to: list[str], history: list[dict], validations: list[dict] = (), *,
                 recipe: Optional[Recipe] = None) -> None:
        self.path = output_dir / LOG_FILE
        # a resumed run rewrites the log from the checkpoint: steps after it were never kept;
        # a step's validation lines (``kind``) follow its training line
        lines = sorted([*history, *validations], key=lambda r: (r["step"], "kind" in r))
        self.path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        self.tensorboard = self.wandb = self.tensorboard_failure = None
        if "tensorboard" in report_to:
            self.tensorboard, self.tensorboard_failure = _tensorboard(output_dir, len(history), recipe)
        if "wandb" in report_to:
            import wandb

            self.wandb = _wandb_run(wandb, output_dir, resumed=bool(history), recipe=recipe)

    def write(self, record: dict, report: bool = True) -> None:
        """Every step goes to the JSONL file (the full loss curve); ``report`` also sends it to
        TensorBoard / W&B (the recipe's log steps). A full disk met by TensorBoard's thread
        since the last step is raised here."""
        if self.tensorboard_failure is not None:
            self.tensorboard_failure.check()
        self._append(record)
        if report:
            self._report({f"train/{k}": v for k, v in record.items() if k != "step"}, record["step"])

    def write_validation(self, record: dict) -> None:
        """A validation record (``kind``, ``step``, ``metrics`` named ``val/...``): a line in
        the JSONL file, its metrics to every tracker at its step."""
        self._append(record)
        self._report(record["metrics"], record["step"])

    def _append(self, record: dict) -> None:
        """One line of the JSONL file; a failed write (a full disk) is an ``OSError`` naming it."""
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise OSError(err.errno, err.strerror or str(err), str(self.path)) from err

    def _report(self, scalars: dict, step: int) -> None:
        if self.tensorboard is not None:
            try:  # TensorBoard raises its thread's error at the next event too
                for key, value in scalars.items():
                    self.tensorboard.add_scalar(key, value, step)
            except OSError as err:
                raise self.tensorboard_failure.named(err) from err
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Every tracker finished; a full disk in TensorBoard's last events is raised here
        (closing joins its thread, so its hook has run)."""
        if self.tensorboard is not None:
            try:
                self.tensorboard.close()
            except OSError as err:
                raise self.tensorboard_failure.named(err) from err
            self.tensorboard_failure.remove()
            self.tensorboard_failure.check()
        if self.wandb is not None:
            self.wandb.finish()
