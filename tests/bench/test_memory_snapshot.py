"""The allocator-trace replay that names what is alive at a GPU step's peak
(sparse_ft/bench/memory_snapshot.py), on hand-made traces: the GPU records, this reads."""

import pytest
import torch

from sparse_ft.bench.memory_snapshot import peak_breakdown, record_peak, where

MODEL = {"filename": "/site/transformers/models/llama/modeling_llama.py", "line": 7, "name": "forward"}
BACKWARD = {"filename": "/site/torch/_tensor.py", "line": 600, "name": "backward"}
OURS = {"filename": "/repo/attn_patterns/patterns.py", "line": 3, "name": "forward"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr):
    return {"action": "free_completed", "addr": addr}


def test_peak_is_the_largest_live_total_and_names_who_holds_it():
    trace = [alloc(1, 100, MODEL), alloc(2, 50, OURS, BACKWARD), free(1), alloc(3, 120, BACKWARD), free(3),
             alloc(4, 10, MODEL)]
    result = peak_breakdown(trace, base_bytes=1000)
    assert result["peak_bytes"] == 1000 + 170 and result["at_event"] == 3
    groups = {g["where"]: g["bytes"] for g in result["groups"]}
    # block 1 was freed before the peak, block 4 allocated after it: neither is counted
    assert groups == {"autograd engine (backward)": 120, "attn_patterns/patterns.py:3 forward (backward)": 50}


def test_innermost_model_frame_names_the_block():
    assert where([OURS, MODEL]) == "attn_patterns/patterns.py:3 forward"
    assert where([]) == "?"


def test_frees_of_blocks_from_before_recording_are_ignored():
    result = peak_breakdown([free(9), alloc(1, 5, MODEL)], top=1)
    assert result["peak_bytes"] == 5 and result["other_bytes"] == 0


@pytest.mark.gpu
def test_record_peak_on_a_gpu_names_a_matmul():
    a = torch.randn(1024, 1024, device="cuda")
    result = record_peak(lambda: (a @ a).sum())
    assert result["peak_bytes"] >= 4 * 1024 * 1024 and not result["truncated"]


def test_a_cpp_autograd_node_names_a_backward_buffer():
    node = {"filename": "", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"}
    assert where([node, BACKWARD]) == "MmBackward0 (backward)"
