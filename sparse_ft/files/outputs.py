"""Everything sparse-ft writes goes through here, so that nothing a user had is lost and no
reader ever sees half of a file:

* files are written to a temporary sibling and renamed into place (``atomic_file``), and what
  must survive a crash is flushed to disk first (``write_synced``, ``fsync_dir``);
* directories are built in a temporary sibling and renamed onto the target
  (``atomic_directory``); they carry ``OUTPUT_MARKER`` naming the command that wrote them, and
  only a directory carrying it is ever replaced;
* an output may not overlap an input (``check_apart``), and every output place is checked
  writable before the work starts (``check_parent_writable``, ``check_output_dir``);
* a run directory is held by a lock file naming its process (``RunLock``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

OUTPUT_MARKER = ".sparse-ft-output"  # in every directory sparse-ft writes, naming the command


def check_parent_writable(path: Path, flag: str) -> None:
    """Fail before the work, not after it: ``path``'s directory (created if missing) takes a
    new file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {path.parent} ({err.strerror or err})") from None


def file_in_the_way(directory: Path) -> Optional[Path]:
    """The file that keeps ``directory`` from being one: itself, or the nearest of its parents
    that exists, when that is no directory; None when it can be made (or is one)."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def check_output_dir(directory: Path, overwrite: bool = False, flag: str = "--output") -> None:
    """Refuse, before any work, to write where something would be lost or cannot be written:
    a file, a non-empty directory sparse-ft did not write (no ``OUTPUT_MARKER``), one it did
    write unless ``overwrite``, a read-only place. Nothing but a directory this toolkit wrote
    is ever replaced."""
    check_parent_writable(directory, flag)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{flag} {directory} is a file, not a directory")
    if not any(directory.iterdir()):
        return
    marker = directory / OUTPUT_MARKER
    if not marker.is_file():
        raise ValueError(f"{flag} {directory} is not empty and was not written by sparse-ft (no {OUTPUT_MARKER}); "
                         "name a new or empty directory")
    if not overwrite:
        raise ValueError(f"{flag} {directory} holds the output of `{marker.read_text().strip()}`; "
                         "pass --overwrite to replace it")


def check_apart(output: Path, flag: str, inputs: dict[str, Optional[str | os.PathLike]]) -> None:
    """Refuse an output directory that is, contains or lies inside a local input (``{flag:
    path}``): writing it would replace or mix with what the command reads."""
    out = Path(output).resolve()
    for name, value in inputs.items():
        if value is None or not Path(value).exists():
            continue
        source = Path(value).resolve()
        if out == source or source in out.parents or out in source.parents:
            raise ValueError(f"{flag} {output} overlaps {name} {value}; write the output outside it")


def _clear(path: Path, flag: str) -> None:
    """A sibling a crashed write left behind; only what sparse-ft wrote is removed."""
    check_output_dir(path, True, flag)
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_directory(directory: Path, writer: str = "sparse-ft", overwrite: bool = True,
                     flag: str = "output directory") -> Iterator[Path]:
    """A temporary sibling of ``directory`` to write into, renamed onto it when the block ends:
    a crash midway leaves the previous directory (or none), never half of one. The result
    carries ``OUTPUT_MARKER`` naming ``writer``; what is already there is replaced only when
    ``check_output_dir`` allows it (checked again just before the rename)."""
    directory = Path(directory)
    check_output_dir(directory, overwrite, flag)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = directory.with_name(directory.name + ".tmp"), directory.with_name(directory.name + ".old")
    _clear(tmp, flag)
    tmp.mkdir()
    (tmp / OUTPUT_MARKER).write_text(writer + "\n")
    try:
        yield tmp
        check_output_dir(directory, overwrite, flag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _clear(old, flag)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


PARTIAL = ".partial"  # <file>.<host>.<pid>.<random>.partial: a file being written


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """``open(path, mode)`` on a temporary sibling that replaces ``path`` when the block ends
    without an error (and is removed when it does not). The sibling's name is this call's own
    and names its host and process, so that :func:`remove_stale_partials` can tell one a
    killed writer left from one being written."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{PARTIAL}")
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove the temporary siblings of ``path`` (:func:`atomic_file`'s) whose writer was on this
    host and is gone (killed mid-write); another host's, or a live process's, are left alone.
    Returns those removed."""
    removed = []
    for tmp in path.parent.glob(f"{path.name}.*{PARTIAL}"):
        writer = tmp.name[len(path.name) + 1 : -len(PARTIAL)].rpartition(".")[0]  # host.pid
        host, _, pid = writer.rpartition(".")
        if host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Checkpoint bytes: a failing write (ENOSPC) is an ``OSError`` naming the file, and a
    written file is on disk before the next step."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err


RUN_LOCK = "train.lock"  # in a training run's output directory


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host."""
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
        self.path = output_dir / RUN_LOCK
        self.me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> None:
        while not self._create():
            holder = self._holder()
            if holder is None:
                continue  # released in between
            pid, host = holder.get("pid"), holder.get("host")
            if host != self.me["host"] or not isinstance(pid, int) or process_alive(pid):
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
        aside = self.path.with_name(f"{RUN_LOCK}.stale-{os.getpid()}")
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
