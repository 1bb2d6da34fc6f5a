"""A run owns its ``train.output_dir``: a lock file keeps a second run out (two runs writing the
same checkpoints and log corrupt each other), and a fresh run does not inherit an earlier run's
checkpoints (pruning by step number would delete the new run's and keep the old, and a later
``resume=auto`` would continue the old run)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from sparse_ft.train.checkpoint import checkpoint_dirs

LOCK = "train.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """``output_dir/train.lock`` holding the pid and host of the run, created atomically
    (``O_CREAT | O_EXCL``). A lock whose process is gone from this host is taken over; one from
    another host cannot be checked from here and is refused like a live one."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / LOCK
        self.me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> None:
        while not self._create():
            holder = self._holder()
            if holder is None:
                continue  # released in between
            pid, host = holder.get("pid"), holder.get("host")
            if host != self.me["host"] or not isinstance(pid, int) or _alive(pid):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
                raise ValueError(
                    f"train.output_dir={self.path.parent} is in use by another run (pid {pid} on {host}, since {since}): "
                    f"wait for it, choose another train.output_dir, or delete {self.path} if that run is gone"
                )
            self._take_over(holder)
        self.held = True

    def release(self) -> None:
        """Remove the lock if this run holds it. Every exit path calls this, an exception's
        too, so it never raises itself."""
        if self.held:
            try:
                mine = json.loads(self.path.read_text()) == self._record()
            except (OSError, ValueError):
                mine = False
            if mine:
                self.path.unlink(missing_ok=True)
        self.held = False

    def _record(self) -> dict:
        return {**self.me, "since": self.since}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self.since = time.time()
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self._record()))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _holder(self) -> Optional[dict]:
        """The lock's record; ``None`` once it is gone. Its creator writes it right after the
        exclusive create, so an empty or partial record is given a moment before it counts as
        unreadable."""
        for _ in range(20):
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return None
            try:
                record = json.loads(text)
                if isinstance(record, dict):
                    return record
            except json.JSONDecodeError:
                pass
            time.sleep(0.1)
        raise ValueError(f"train.output_dir={self.path.parent} has an unreadable lock {self.path}: delete it if no run is using the directory")

    def _take_over(self, stale: dict) -> None:
        """Move the stale lock aside (one process wins the rename); a lock that turns out not to
        be the stale one (another run took it over first) is put back."""
        aside = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except ValueError:
            moved = None
        if moved == stale:
            print(f"taking over the stale lock {self.path} of pid {stale['pid']} on {stale['host']} (that process is gone)", flush=True)
        else:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink()


def claim_checkpoints(output_dir: Path, resume: str, overwrite: bool) -> None:
    """A fresh run (``resume=never``) may only start beside an earlier run's checkpoints if the
    recipe says ``train.overwrite_output_dir``; then those checkpoints, and nothing else, go."""
    old = checkpoint_dirs(output_dir)
    if resume != "never" or not old:
        return
    names = ", ".join(p.name for p in old)
    if not overwrite:
        raise ValueError(
            f"train.resume=never: train.output_dir={output_dir} holds an earlier run's checkpoints ({names}); "
            "resume it with train.resume=auto, choose another train.output_dir, or set train.overwrite_output_dir=true to delete them"
        )
    for path in old:
        shutil.rmtree(path)
    print(f"train.overwrite_output_dir: deleted {names} from {output_dir}", flush=True)
