"""Each pattern's SDPA pieces on this GPU against a fp32 dense reference (values and the three
gradients), under each of SDPA's CUDA backends alone, one subprocess per backend and head dim
(an illegal memory access ends its process, not the sweep). How cuDNN was found wrong on the
pieces' strided views (attn_patterns.kernels.PIECE_SDPA):

    python scripts/sdpa_views.py            # the pieces as they run: cuDNN left out
    python scripts/sdpa_views.py --raw      # the pieces with cuDNN allowed, as before 2026-11-26

Errors above 0.05 are marked BAD. Needs CUDA.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "default")


def sweep(raw: bool) -> None:
    for dim in (64, 128):
        for backend in BACKENDS:
            args = [sys.executable, __file__, "--one", backend, str(dim)] + (["--raw"] if raw else [])
            done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
            print(done.stdout, end="", flush=True)
            if done.returncode:
                print(f"{backend} d={dim}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", flush=True)


def one(backend: str, dim: int, raw: bool) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attn_patterns
    from attn_patterns import strided
    from attn_patterns.reference import dense_attention
    from test_patterns import PATTERNS, qkv

    if raw:
        strided.piece_kernels = lambda device_type: contextlib.nullcontext()
    pinned = (lambda: sdpa_kernel([getattr(SDPBackend, backend)])) if backend != "default" else contextlib.nullcontext
    n, heads = 1000, 8
    for dtype in (torch.bfloat16, torch.float16):
        for name, params in PATTERNS:
            label = f"{backend:20s} d={dim} {str(dtype)[6:]:8s} {name}{params or ''}"
            try:
                pattern = attn_patterns.get(name, **params)
                q, k, v = (x.cuda().requires_grad_() for x in qkv(n, 2, dtype=dtype, dim=dim, grad=False))
                with pinned():
                    out = pattern(q, k, v, backend="sdpa")
                q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
                ref = dense_attention(q32, k32, v32, pattern.mask(n, heads).cuda())
                cot = torch.randn_like(ref)
                with pinned():
                    grads = torch.autograd.grad(out, (q, k, v), cot.to(dtype))
                errs = [(out.float() - ref).abs().max().item()]
                errs += [(a.float() - b).abs().max().item() for a, b in zip(grads, torch.autograd.grad(ref, (q32, k32, v32), cot))]
                torch.cuda.synchronize()
                bad = any(math.isnan(e) or e > 0.05 for e in errs)
                print(f"{label}: out {errs[0]:.3g} dq {errs[1]:.3g} dk {errs[2]:.3g} dv {errs[3]:.3g}" + ("  BAD" if bad else ""),
                      flush=True)
            except Exception as err:  # noqa: BLE001  a backend's refusal or failure is the finding
                print(f"{label}: {type(err).__name__}: {str(err).splitlines()[0][:160]}", flush=True)
                if "illegal memory access" in str(err):
                    raise SystemExit(3) from None


if __name__ == "__main__":
    raw = "--raw" in sys.argv
    if "--one" in sys.argv:
        i = sys.argv.index("--one")
        one(sys.argv[i + 1], int(sys.argv[i + 2]), raw)
    else:
        sweep(raw)
