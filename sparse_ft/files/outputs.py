"""Everything sparse-ft writes goes through here, so that nothing a user had is lost and no
reader ever sees half of a file:

* files are written to a temporary sibling and renamed into place (``atomic_file``), and what
  must survive a crash is flushed to disk first (``write_synced``, ``fsync_dir``);
* directories are built in a temporary sibling and swapped onto the target
  (``atomic_directory``, ``replace_directory``); they carry ``OUTPUT_MARKER`` naming the command
  that wrote them, and only a directory carrying it is ever replaced;
* every temporary path is new and unique to the call (``scratch_directory``: ``.NAME.XXXXXXXX``
  + ``SCRATCH_SUFFIX`` beside ``NAME``), and it is the only thing a call removes: a fixed sibling
  name (``NAME.old``, ``NAME.tmp``) may be a user's backup or another command's input;
* a directory a command keeps writing into (a training run, the experiment's results) is
  claimed with a marker too (``claim_directory``): the names the command writes there are its
  own, any other file in it is the user's;
* a results file carries its marker inside (``written_by``: a JSON field, a PNG text chunk, a
  markdown comment); an existing file without one is never replaced (``check_output_file``);
* outputs are not written through symbolic links, and an output may not overlap an input
  (``check_apart``); every output place is checked writable before the work starts
  (``check_parent_writable``, ``check_output_dir``);
* a run directory is held by a lock file naming its process (``RunLock``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Optional

OUTPUT_MARKER = ".sparse-ft-output"  # in every directory sparse-ft writes, naming the command
OUTPUT_FIELD = "sparse_ft_output"  # in every results file sparse-ft writes (JSON field, PNG text), naming the command
SHARED = "shared"  # the marker's second line in a claimed directory: files it does not name are the user's
SCRATCH_SUFFIX = ".sparse-ft-tmp"  # ends every temporary path: a leftover of a crash is recognisably sparse-ft's
_MARKDOWN = re.compile(rf"^<!-- {OUTPUT_FIELD}: (.+) -->$")
_PNG = b"\x89PNG\r\n\x1a\n"


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


def _refuse_link(path: Path, flag: str) -> None:
    """Writing through a link would replace a file somewhere else, one sparse-ft never saw."""
    if path.is_symlink():
        raise ValueError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); sparse-ft does not write through links: "
                         "remove the link or name another path")


def marker(directory: Path) -> Optional[tuple[str, bool]]:
    """``(command, shared)`` of a directory carrying ``OUTPUT_MARKER``; ``None`` for any other.
    ``shared``: a directory the command writes into (``claim_directory``), not one it wrote
    whole."""
    try:
        lines = (Path(directory) / OUTPUT_MARKER).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return (lines[0].strip(), SHARED in lines[1:]) if lines else None


def _png_text(path: Path, key: str) -> Optional[str]:
    """The PNG text chunk ``key`` (matplotlib writes them before the image data)."""
    with open(path, "rb") as f:
        if f.read(len(_PNG)) != _PNG:
            return None
        while len(head := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", head)
            if kind in (b"IDAT", b"IEND"):
                return None
            data = f.read(length + 4)[:length]
            name, _, value = data.partition(b"\0")
            if kind == b"tEXt" and name == key.encode():
                return value.decode("latin-1")
    return None


def written_by(path: Path) -> Optional[str]:
    """The command that wrote ``path``, read from the marker it carries: a directory's
    ``OUTPUT_MARKER``, a JSON object's ``OUTPUT_FIELD`` (in JSON lines, the first row's), a PNG's
    text chunk of that name, a markdown file's last line (``markdown_marker``). ``None`` for
    anything else: a file sparse-ft did not write, or wrote before it marked its files."""
    path = Path(path)
    if path.is_dir():
        found = marker(path)
        return found[0] if found else None
    try:
        if path.suffix in (".json", ".jsonl"):
            with open(path) as f:
                payload = json.loads(f.read() if path.suffix == ".json" else f.readline())
            writer = payload.get(OUTPUT_FIELD) if isinstance(payload, dict) else None
        elif path.suffix == ".png":
            writer = _png_text(path, OUTPUT_FIELD)
        elif path.suffix == ".md":
            match = _MARKDOWN.match((path.read_text().splitlines() or [""])[-1])
            writer = match.group(1) if match else None
        else:
            writer = None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return writer if isinstance(writer, str) and writer else None


def markdown_marker(writer: str) -> str:
    """The last line of a markdown file ``writer`` wrote (an HTML comment: invisible when shown)."""
    return f"<!-- {OUTPUT_FIELD}: {writer} -->"


def _check_replaceable(output: str, writer: Optional[str], foreign: str, overwrite: bool) -> None:
    """``output`` (its flag and path) is replaced only when ``writer``, sparse-ft's command, wrote it."""
    if writer is None:
        raise ValueError(f"{output} {foreign}")
    if not overwrite:
        raise ValueError(f"{output} holds the output of `{writer}`; pass --overwrite to replace it")


def check_output_dir(directory: Path, overwrite: bool = False, flag: str = "--output") -> None:
    """Refuse, before any work, to write where something would be lost or cannot be written:
    a file, a link, a non-empty directory sparse-ft did not write (no ``OUTPUT_MARKER``), one it
    did write unless ``overwrite``, one a command writes into beside the user's files (a
    training run), a read-only place. Nothing but a directory this toolkit wrote whole is ever
    replaced."""
    check_parent_writable(directory, flag)
    _refuse_link(directory, flag)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{flag} {directory} is a file, not a directory")
    if not any(directory.iterdir()):
        return
    found = marker(directory)
    if found is not None and found[1]:
        raise ValueError(f"{flag} {directory} is the directory of `{found[0]}`, which may hold files of yours beside its own; "
                         "name a new or empty directory")
    _check_replaceable(f"{flag} {directory}", found and found[0], f"is not empty and was not written by sparse-ft "
                       f"(no {OUTPUT_MARKER}); name a new or empty directory", overwrite)


def check_output_file(path: Path, flag: str, overwrite: bool = False) -> None:
    """Refuse, before any work, a results file that cannot be written or would lose something:
    a directory, a link, an existing file sparse-ft did not write (``written_by``), one it wrote
    unless ``overwrite``."""
    path = Path(path)
    check_parent_writable(path, flag)
    _refuse_link(path, flag)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file")
    if path.exists():
        _check_replaceable(f"{flag} {path}", written_by(path), f"exists and was not written by sparse-ft (it carries no "
                           f"{OUTPUT_FIELD} marker); name a new file or move it away", overwrite)


def check_apart(output: Path, flag: str, inputs: dict[str, Optional[str | os.PathLike]]) -> None:
    """Refuse an output (file or directory) that is, contains or lies inside a local input
    (``{flag: path}``): writing it would replace or mix with what the command reads. A ``Path``
    is local whether or not it exists yet (an input the command builds first); a string that
    names nothing here may be a Hub id and is not an input here."""
    out = Path(output).resolve()
    for name, value in inputs.items():
        if value is None or not (isinstance(value, Path) or Path(value).exists()):
            continue
        source = Path(value).resolve()
        if out == source or source in out.parents or out in source.parents:
            raise ValueError(f"{flag} {output} overlaps {name} {value}; write the output outside it")


def check_claimable(directory: Path, writer: str, flag: str, *, legacy: Callable[[Path], bool] = lambda _: False) -> bool:
    """Refuse, writing nothing, what :func:`claim_directory` would: a file, another command's
    output, a non-empty directory of the user's. True when the directory is still to be marked."""
    directory = Path(directory)
    check_parent_writable(directory, flag)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{flag} {directory} is a file, not a directory")
    found = marker(directory)
    if found is not None:
        if found != (writer, True):
            raise ValueError(f"{flag} {directory} holds the output of `{found[0]}`; name a new or empty directory")
        return False
    if directory.exists() and any(directory.iterdir()):
        if legacy(directory):
            return False
        raise ValueError(f"{flag} {directory} is not empty and was not written by `{writer}` (no {OUTPUT_MARKER}); "
                         "name a new or empty directory")
    return True


def claim_directory(directory: Path, writer: str, flag: str, *, legacy: Callable[[Path], bool] = lambda _: False) -> None:
    """Make ``directory`` the one ``writer`` keeps writing into: a new or empty one is marked
    (``OUTPUT_MARKER`` naming ``writer``, shared); one marked so already, or one written before
    markers that ``legacy`` recognises (left as it is: a command refused later has changed
    nothing), stays ``writer``'s. Any other is refused: a non-empty directory of the user's,
    another command's output. A link to a directory is followed: the user has put it there."""
    directory = Path(directory)
    if not check_claimable(directory, writer, flag, legacy=legacy):
        return
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(directory / OUTPUT_MARKER) as f:
        f.write(f"{writer}\n{SHARED}\n")


def remove_claimed(directory: Path, names: Iterable[str]) -> None:
    """Remove ``names`` (what its command wrote) from a directory ``claim_directory`` gave it,
    then the marker and the directory once nothing else is left: any other file is the user's."""
    for path in (Path(directory) / name for name in names):
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    if not any(p.name != OUTPUT_MARKER for p in Path(directory).iterdir()):
        (Path(directory) / OUTPUT_MARKER).unlink(missing_ok=True)
        Path(directory).rmdir()


def scratch_directory(target: Path) -> Path:
    """A new, empty directory beside ``target``, unique to this call: ``.NAME.XXXXXXXX.sparse-ft-tmp``."""
    target = Path(target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=SCRATCH_SUFFIX, dir=target.parent))
    scratch.chmod(0o777 & ~_umask())  # what mkdir would have made, not mkdtemp's owner-only: it may become the output
    return scratch


def scratch_file(target: Path) -> Path:
    """A new, empty file beside ``target``, unique to this call: ``.NAME.HOST.PID.XXXXXXXX.sparse-ft-tmp``,
    so that :func:`remove_stale_scratch` can tell one a killed writer left from one being written."""
    target = Path(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.{socket.gethostname()}.{os.getpid()}.", suffix=SCRATCH_SUFFIX,
                                dir=target.parent)
    os.close(fd)  # opened again by name: a writer may read ``f.name``
    return Path(name)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    system or the filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_directory(new: Path, target: Path) -> None:
    """Put the directory ``new`` at ``target`` and remove what was there, and nothing else.
    Where the filesystem can exchange two paths, a crash at any moment leaves the old or the new
    directory at ``target`` and at most one ``SCRATCH_SUFFIX`` leftover; elsewhere the old one is
    renamed to a scratch name of its own first, so a crash between the two renames leaves both
    under scratch names (the old one carrying its marker), and a failed second rename puts the
    old one back."""
    new, target = Path(new), Path(target)
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # the old directory, now under the scratch name
        return
    aside = scratch_directory(target)
    os.replace(target, aside)  # onto the empty scratch directory
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def atomic_directory(directory: Path, writer: str = "sparse-ft", overwrite: bool = True,
                     flag: str = "output directory") -> Iterator[Path]:
    """A scratch directory to write into (``scratch_directory``), put in place of ``directory``
    when the block ends (``replace_directory``): a crash midway leaves the previous directory
    (or none), never half of one. The result carries ``OUTPUT_MARKER`` naming ``writer``; what
    is already there is replaced only when ``check_output_dir`` allows it (checked again just
    before the swap). Only the scratch directory, and what it replaced, are ever removed."""
    directory = Path(directory)
    check_output_dir(directory, overwrite, flag)
    tmp = scratch_directory(directory)
    try:
        (tmp / OUTPUT_MARKER).write_text(writer + "\n")
        yield tmp
        check_output_dir(directory, overwrite, flag)
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """``open(path, mode)`` on a scratch file unique to this call, which replaces ``path`` when
    the block ends without an error (and is removed when it does not). A link at ``path`` is
    replaced, never written through."""
    path = Path(path)
    tmp = scratch_file(path)
    try:
        tmp.chmod(0o666 & ~_umask())  # what open() would have made, not mkstemp's owner-only
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_scratch(path: Path) -> list[Path]:
    """Remove the scratch files of ``path`` (:func:`scratch_file`'s) whose writer was on this
    host and is gone (killed mid-write); another host's, or a live process's, are left alone.
    Returns those removed."""
    removed = []
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{prefix}*{SCRATCH_SUFFIX}"):
        writer = tmp.name[len(prefix) : -len(SCRATCH_SUFFIX)].rpartition(".")[0]  # host.pid
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


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write the run cannot make until space is freed


def os_error(err: Exception, path: Path) -> Optional[OSError]:
    """A library's error for a failed write as the ``OSError`` it reports, naming ``path``
    (safetensors' writer, under PEFT's ``save_pretrained``, raises ``SafetensorError: ... No
    space left on device (os error 28)``), so that a full disk is the one line every other
    write gives; None for an error that is no failed write."""
    if isinstance(err, OSError):
        return err
    found = re.search(r"\(os error (\d+)\)", str(err))
    if found is None:
        return None
    code = int(found[1])
    return OSError(code, os.strerror(code), str(path))


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
        raise ValueError(f"train.output_dir={self.path.parent} has an unreadable lock {self.path}: "
                         "delete it if no run is using the directory")

    def _take_over(self, stale: dict) -> None:
        """Move the stale lock aside (one process wins the rename); a lock that turns out not to
        be the stale one (another run took it over first) is put back."""
        aside = scratch_file(self.path)
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            aside.unlink()
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
