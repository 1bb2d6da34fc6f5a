"""Process-group setup for the three ways train.py starts: the ``deepspeed`` launcher,
``torchrun`` (both export RANK/WORLD_SIZE/MASTER_*), and a bare ``python train.py``.

A bare process with a DeepSpeed config is a world of one: DeepSpeed would otherwise go looking
for MPI (and fail on ``import mpi4py``), so the rendezvous variables are filled in here.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_world_size() -> int:
    """Processes on this node: torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return int(os.environ.get("WORLD_SIZE", "1"))


def share_cpu_threads() -> None:
    """Several CPU ranks each using every core oversubscribe the machine (OpenMP threads spin:
    a 100x slowdown measured on 2 cores). Split the cores between the node's ranks unless the
    user chose OMP_NUM_THREADS; torchrun does the same."""
    local = local_world_size()
    if local > 1 and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _skip_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when the process group
    starts: a C++ build (minutes on a busy machine, needs a compiler, rebuilt whenever another
    environment touched the shared extension cache) for a kernel only inference all-reduce
    uses. ZeRO training talks through the gloo process group, so the op is marked unavailable
    (DeepSpeed keeps this table for exactly such edits)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def end_distributed() -> None:
    """End a launched multi-process run whose work is done: destroy its process group, run
    Python's exit handlers, flush, and leave with ``os._exit(0)``, skipping only the C++ static
    destructors. Left to the interpreter's exit, a thread of the collectives' stack is torn down
    while still joinable, and a rank that had saved everything aborted there ("terminate called
    without an active exception", exit 250) in CI under load, twice, the second time after the
    group was already destroyed here. A single process returns, keeping its group: tests run
    several in one."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit would run: logging's flush, temporary directories
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_distributed(use_deepspeed: bool) -> tuple[int, int]:
    """Returns ``(rank, world_size)``."""
    if not use_deepspeed:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"deepspeed=null trains in one process, but the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']}: "
                "set deepspeed to a config in ds_configs/ (e.g. deepspeed=zero3_bf16) for several processes"
            )
        return 0, 1
    if not dist.is_initialized():
        if not any(key in os.environ for key in ("RANK", "WORLD_SIZE")):
            defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}
            for key, value in defaults.items():
                os.environ.setdefault(key, value)
        share_cpu_threads()
        if not torch.cuda.is_available():
            _skip_shared_memory_allreduce()
        # ZeRO calls collectives that torch deprecated: a warning per call would bury the log
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()
