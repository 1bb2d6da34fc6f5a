"""Which dense kernel SDPA runs here, named from the profiler, pinned for a whole comparison.

Why: SDPA picks its kernel per call (cuDNN, FlashAttention-2, memory-efficient, math; on a CPU
its fused kernel or math) from the device, dtype, shapes and mask. A baseline left to choose may
run a faster kernel than the patterns' pieces get, or a slower one, and a ratio between them
then measures the choice, not the pattern. So a benchmark runs one dense causal call
unpinned under the profiler, names the implementation op it dispatched to (and on CUDA the
longest device kernel under each op), and runs the baseline and every pattern under
``sdpa_kernel`` of that one backend. A piece that backend cannot take fails as
:class:`~sparse_ft.bench.machine.Unrunnable` (recorded in its row) instead of running another
kernel unseen. Methods that call torch's fused ops directly (DCA's log-sum-exp pieces) are
not steered by the pin: :func:`attention_ops` names what they ran.

FLOPs are counted as FlashAttention's benchmarks count them, over the (head, query, key) pairs a
call computes: 4·pairs·D forward (two matmuls), a backward of 2.5× that (five matmuls), so
3.5× for forward+backward.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from sparse_ft.bench.machine import Unrunnable

# SDPA's implementation ops (their backward ops add ``_backward``) -> the SDPBackend that runs them.
BACKEND_OF_OP = {
    "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
    "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
    "aten::_scaled_dot_product_attention_math": "MATH",
    "aten::_scaled_dot_product_fused_attention_overrideable": "OVERRIDEABLE",
}
# The backends by their short names (``--sdpa-backend``, the tables' column): flash, cudnn, efficient, ...
BACKENDS = {name.removesuffix("_ATTENTION").lower(): name for name in dict.fromkeys(BACKEND_OF_OP.values())}
# Ops that are attention kernels wherever they are called from: SDPA's, torch's fused ops
# called directly, the flash-attn package's custom ops.
_ATTENTION_OP = re.compile(r"^aten::_scaled_dot_product_|^aten::_efficient_attention|^aten::_flash_attention|"
                           r"^aten::_cudnn_attention|flash_attn")
# SDPA's messages when no kernel of the allowed backends takes a call (CUDA, CPU).
_NO_KERNEL = ("No available kernel", "No viable backend")
FORWARD_FLOPS_PER_PAIR = 4  # × head dim: Q·Kᵀ and P·V, a multiply and an add each
BACKWARD_FACTOR = 2.5  # the backward's five matmuls against the forward's two


def flops(pairs: int, head_dim: int, *, backward: bool) -> float:
    return FORWARD_FLOPS_PER_PAIR * pairs * head_dim * (1 + BACKWARD_FACTOR if backward else 1)


def tflops(pairs: int, head_dim: int, ms: Optional[float], *, backward: bool) -> Optional[float]:
    """TFLOP/s of computing ``pairs`` in ``ms`` milliseconds; None without a time."""
    return flops(pairs, head_dim, backward=backward) / ms / 1e9 if ms else None


def _kernel_name(raw: str) -> str:
    """A device kernel's name without its return type, template and call arguments."""
    name = raw.removeprefix("void ")
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or raw


def _descendants(event) -> list:
    found, stack = [], [event]
    while stack:
        e = stack.pop()
        found.append(e)
        stack.extend(e.cpu_children)
    return found


def attention_ops(run: Callable[[], object], device: torch.device) -> list[tuple[str, str]]:
    """``run()`` once under the profiler: the attention ops it dispatched to, in the order they
    started (outermost only: SDPA's flash op calls ``_flash_attention_forward`` inside), each with
    the longest device kernel launched under it (CUDA; "" on a CPU, where the op is the kernel)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    found = []
    for event in prof.events():
        if not _ATTENTION_OP.search(event.name):
            continue
        parent = event.cpu_parent
        while parent is not None and not _ATTENTION_OP.search(parent.name):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        kernels = [k for e in _descendants(event) for k in e.kernels]
        longest = max(kernels, key=lambda k: k.duration, default=None)
        found.append((event.name, _kernel_name(longest.name) if longest else ""))
    return found


def describe_ops(ops: list[tuple[str, str]]) -> list[str]:
    """Each distinct (op, kernel) once, in order: ``op`` or ``op: kernel``."""
    return list(dict.fromkeys(f"{op}: {kernel}" if kernel else op for op, kernel in ops))


@dataclass(frozen=True)
class DenseKernel:
    """The kernel an unpinned dense causal call ran: the SDPBackend pinned from then on, the
    implementation ops of the profiled call (forward, then backward) and, on CUDA, the longest
    device kernel under each."""

    backend: str
    ops: tuple[str, ...]
    kernels: tuple[str, ...]

    @property
    def label(self) -> str:
        """Short, for a table column: flash, cudnn, efficient, math (a key of ``BACKENDS``)."""
        return self.backend.removesuffix("_ATTENTION").lower()

    @property
    def detail(self) -> str:
        """The names a reader can look up: the device kernels (CUDA), else the ops."""
        return ", ".join(k for k in self.kernels if k) or ", ".join(self.ops)

    @property
    def piece_backend(self) -> str:
        """The backend a pattern's pieces are pinned to beside this baseline: the same one, unless
        it is cuDNN, which pieces never run (``attn_patterns.kernels.PIECE_SDPA`` says why): then
        the first they do run. The baseline keeps the fastest dense kernel either way."""
        from attn_patterns.kernels import PIECE_SDPA

        return self.backend if self.backend in PIECE_SDPA else PIECE_SDPA[0]

    def pin(self, run: Callable[[], object], *, pieces: bool = False) -> Callable[[], object]:
        """``run`` with every SDPA call inside it restricted to this backend (``pieces``: to
        :attr:`piece_backend`, for a pattern's run); a call it cannot take raises
        :class:`Unrunnable` naming the backend."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        name = self.piece_backend if pieces else self.backend
        backend = getattr(SDPBackend, name)

        def pinned() -> object:
            with sdpa_kernel(backend):
                try:
                    return run()
                except RuntimeError as err:
                    if not any(message in str(err) for message in _NO_KERNEL):
                        raise
                    raise Unrunnable(f"no {name.removesuffix('_ATTENTION').lower()} kernel for one of its SDPA calls "
                                     f"(SDPA pinned to {name}, beside the dense baseline's {self.backend})") from None

        return pinned


def find(run: Callable[[], object], device: torch.device, backend: Optional[str] = None) -> Optional[DenseKernel]:
    """The kernel SDPA picks for ``run`` (one dense causal call, forward or forward+backward),
    from one unpinned run under the profiler; None if it ran out of memory. ``backend`` (a key
    of ``BACKENDS``): the call runs under that backend instead of SDPA's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])) if backend else nullcontext():
            ops = attention_ops(run, device)
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    except RuntimeError as err:
        if backend is None or not any(message in str(err) for message in _NO_KERNEL):
            raise
        raise ValueError(f"--sdpa-backend {backend}: SDPA has no {backend} kernel for a dense causal call of these "
                         f"shapes here; use auto (the kernel SDPA picks)") from None
    forward = [op for op, _ in ops if not op.endswith("_backward")]
    if not forward or forward[0] not in BACKEND_OF_OP:
        raise RuntimeError(f"the profiler saw no SDPA implementation op in a dense causal call (attention ops: "
                           f"{[op for op, _ in ops] or 'none'}); known: {', '.join(BACKEND_OF_OP)}")
    return DenseKernel(BACKEND_OF_OP[forward[0]], tuple(op for op, _ in ops), tuple(kernel for _, kernel in ops))
