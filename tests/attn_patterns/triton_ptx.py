"""Compiles the Triton kernels, as their wrappers launch them, to PTX for Hopper (sm_90): the
check of their compiled form on a machine without a GPU.

The interpreter (how the rest of the suite runs the kernels) executes the Python of a
``@triton.jit`` function; it does not type-check or lower it, so code that the compiler
refuses (a loop-carried value changing type, a non-constexpr branch returning, a helper's
signature) passes there and fails on the first GPU. Triton's NVIDIA backend compiles without
a device: this script replaces each kernel with a recorder, runs the wrappers forward and
backward on CPU tensors (the launches are recorded, not run), and compiles every recorded
launch with its real argument types and constants. Run with TRITON_INTERPRET=0 (a fresh
process: the interpreter decides at import what ``triton.jit`` returns); prints one line
per compiled launch and exits 1 on the first failure, naming the kernel and its constants.

Usage: ``TRITON_INTERPRET=0 python tests/attn_patterns/triton_ptx.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attn_patterns
import attn_patterns.kernels as backends
import attn_patterns.longheads_triton as longheads_kernel
import attn_patterns.triton_attention as kernels
from attn_patterns.blocks import BlockLayout, block_layout
from attn_patterns.dca import dca_attention
from attn_patterns.longheads import LongHeads
from attn_patterns.rotary import default_inv_freq

TARGET = GPUTarget("cuda", 90, 32)  # Hopper, the GPUs the benchmarks ran on
OPTIONS = ("num_warps", "num_stages")
# torch dtypes as Triton's signature strings
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8"}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is kept."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """The launch's signature, its constexprs and its compile options, from the values."""
    constants = {k: v for k, v in kwargs.items() if k not in OPTIONS}
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    names = kernel.arg_names
    sig: dict[str, str] = {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + POINTEE[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name}={value!r} of an unexpected type")
    for name in names[len(args):]:
        if name not in constants:
            raise TypeError(f"{kernel.__name__}: argument {name} was not passed")
        sig[name] = "constexpr"
    return sig, {(names.index(k),): v for k, v in constants.items()}, options


def record(launches: list) -> None:
    """Every launch the wrappers make for a strided pattern, a rolled-chunk pattern, a mix, a
    pattern with sink tokens, a layout of stepped rows and DCA's three query copies, forward
    and backward, and LongHeads' forward; bf16, D = 128."""
    n, h, hkv, d = 256, 8, 2, 128
    gen = torch.Generator().manual_seed(0)
    for pattern in (attn_patterns.get("sda"), attn_patterns.get("scca_fixed"), attn_patterns.get("longmixed"),
                    attn_patterns.get("sf_attn")):
        q, k, v = (torch.randn(1, x, n, d, generator=gen, dtype=torch.bfloat16).requires_grad_() for x in (h, hkv, hkv))
        kernels.triton_forward(pattern, q, k, v).sum().backward()
    sda = attn_patterns.get("sda")  # as a layout of masked (stepped) rows rather than strided views

    def stepped(tile: kernels.Tiles) -> BlockLayout:
        return block_layout(sda, n, h, block_q=tile.block_q, block_k=tile.block_k, strided=False, device="cpu")

    q, k, v = (torch.randn(1, x, n, d, generator=gen, dtype=torch.bfloat16).requires_grad_() for x in (h, hkv, hkv))
    kernels.block_sparse_attention(q.unsqueeze(0), k, v, stepped, scale=d ** -0.5).sum().backward()
    q, k, v = (torch.randn(1, x, n, d, generator=gen, dtype=torch.bfloat16).requires_grad_() for x in (h, hkv, hkv))
    dca_attention(q, k, v, inv_freq=default_inv_freq(d), chunk_size=96, local_window=32, pretraining_length=128,
                  backend="triton").sum().backward()
    with torch.no_grad():  # LongHeads: forward only; beyond the window of 4 chunks of 64
        q, k, v = (torch.randn(1, x, 2 * n + 100, d, generator=gen, dtype=torch.bfloat16) for x in (h, hkv, hkv))
        LongHeads(chunk_size=64, chunks=4).attend(q, k, v, inv_freq=default_inv_freq(d), backend="triton")


def main() -> int:
    launches: list = []
    for name in ("_fwd_kernel", "_delta_kernel", "_dq_kernel", "_dkv_kernel"):
        setattr(kernels, name, Recorder(getattr(kernels, name), launches))
    longheads_kernel._chosen_kernel = Recorder(longheads_kernel._chosen_kernel, launches)
    backends.triton_unsupported = lambda *args, **kwargs: None  # CPU tensors: the launches are only recorded
    kernels._tiles, longheads_kernel._tiles = kernels.cuda_tiles, longheads_kernel.cuda_tiles  # the GPU's tiles
    record(launches)
    seen = set()
    for kernel, args, kwargs in launches:
        sig, constexprs, options = signature(kernel, args, kwargs)
        key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=TARGET, options=options)
        except Exception as err:  # noqa: BLE001 - any compiler error is the finding
            print(f"{kernel.__name__} {dict(kwargs)}: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        print(f"{kernel.__name__} {dict(kwargs)}: PTX for sm_90")
    return 0 if seen else 1


if __name__ == "__main__":
    sys.exit(main())
