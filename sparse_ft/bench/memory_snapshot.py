"""What holds the memory at a CUDA step's peak, from torch's allocator history
(``torch.cuda.memory._record_memory_history``), named by the code that allocated it.

Why: the planner's peak is a sum of named terms; when a GPU measures more than it predicts
(the H200 found 7 % more at 131k and 180k tokens), only the allocations alive at the measured
peak say which term is missing. The allocator's trace is replayed here (alloc / free events
in order), the moment of the largest live total is found, and the blocks alive then are
grouped by the innermost Python frame of the code that asked for them (inside a backward pass
that is the checkpoint's recomputation, or the ``backward`` call itself for the autograd
engine's own buffers). Nothing is pickled: the result is a JSON-ready list.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

# Frames worth naming: the toolkit's and the libraries' model code. Torch's own frames (autograd
# plumbing, nn.Module.__call__) say nothing about which term a block belongs to.
_OURS = ("sparse_ft/", "attn_patterns/", "transformers/", "peft/", "bitsandbytes/", "torch/utils/checkpoint.py")


def where(frames: Iterable[dict[str, Any]]) -> str:
    """``file:line function`` of the innermost frame in model code, with ``(backward)`` when
    the allocation happened under a ``backward`` call; ``?`` when no frame was recorded
    (blocks allocated before the history started)."""
    frames = list(frames)
    backward = any(f.get("name") == "backward" and "torch/" in f.get("filename", "") for f in frames)
    for f in frames:  # innermost first, as torch records them
        name = f.get("filename", "")
        hit = next((tag for tag in _OURS if tag in name), None)
        if hit is not None:
            short = hit + name.split(hit, 1)[1]
            return f"{short}:{f.get('line', '?')} {f.get('name', '?')}" + (" (backward)" if backward else "")
    # C++ frames (stacks="all") name the autograd node: the kernel's backward that asked
    node = next((f["name"] for f in frames if "Backward" in f.get("name", "") and "::" in f.get("name", "")), None)
    if node is not None:
        return node.split("(")[0].rsplit("::", 2)[-2] + " (backward)"
    return "autograd engine (backward)" if backward else "?"


def peak_breakdown(trace: list[dict[str, Any]], *, base_bytes: int = 0, top: int = 30) -> dict[str, Any]:
    """Replay one device's allocator ``trace`` (the snapshot's ``device_traces[i]``): the peak
    live bytes (``base_bytes``, what was allocated before recording, plus the trace's own), and
    the blocks alive at that moment grouped by :func:`where`, largest first."""
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, event index)
    total = best = 0
    best_at = -1
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], index)
            total += event["size"]
            if total > best:
                best, best_at = total, index
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    alive: dict[int, tuple[int, int]] = {}
    for index, event in enumerate(trace[: best_at + 1]):  # replay again to the peak: who is alive there
        if event.get("action") == "alloc":
            alive[event["addr"]] = (event["size"], index)
        elif event.get("action") == "free_completed":
            alive.pop(event["addr"], None)
    groups: dict[str, list[int]] = defaultdict(list)
    for size, index in alive.values():
        groups[where(trace[index].get("frames", []))].append(size)
    rows = sorted(({"where": k, "bytes": sum(v), "blocks": len(v), "largest": max(v)} for k, v in groups.items()),
                  key=lambda r: -r["bytes"])
    return {"peak_bytes": base_bytes + best, "before_recording_bytes": base_bytes, "events": len(trace),
            "at_event": best_at, "groups": rows[:top], "other_bytes": sum(r["bytes"] for r in rows[top:])}


def record_peak(step: Callable[[], None], *, top: int = 30, max_entries: int = 2_000_000,
                stacks: str = "python") -> dict[str, Any]:
    """Run ``step`` on the current CUDA device under the allocator's history and return
    :func:`peak_breakdown` of it. ``stacks="python"`` by default: C++ symbolisation of a long
    step's events can cost minutes; ``"all"`` where Python's alone fails."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    try:
        # backward on the calling thread: recording Python stacks from the autograd engine's own
        # device thread failed inside the checkpoint's recomputation (torch 2.11, an H200:
        # "cross_entropy_loss returned NULL without setting an exception")
        with torch.autograd.set_multithreading_enabled(False):
            step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    result = peak_breakdown(trace, base_bytes=base, top=top)
    result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    result["truncated"] = len(trace) >= max_entries
    result["stacks"] = stacks
    return result
