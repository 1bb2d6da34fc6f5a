"""What every test runs under: no hub, Triton's interpreter without a GPU, ``gpu``-marked
tests skipped without CUDA, the repository's root importable by child processes."""

import os
from pathlib import Path

# Nothing in the suite may wait on a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Without a GPU, Triton's interpreter runs the block-sparse kernel (backend="triton") on CPU
# tensors. Triton reads this when attn_patterns.triton_attention decorates its kernels, so it
# is set here, before any test module is imported; with a GPU the kernels compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# Child processes (DeepSpeed's ranks, a run killed and resumed, a test file run as a script)
# import the shared test helpers as ``tests.<wing>.<module>``: the repository's root is on
# their path as it is on pytest's.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH")]))
