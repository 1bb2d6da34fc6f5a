"""Training on CUDA: a tiny Llama's bf16 step through each pattern has finite, non-zero
gradients; a one-GPU DeepSpeed run initialises NCCL, trains with FusedAdam and its adapter
reloads to the probe's logits. ``gpu``-marked: collected on CPU, where all are skipped."""

from __future__ import annotations

import json

import pytest
import torch

from sparse_ft import use_attention
from sparse_ft.modeling.tiny import tiny_llama

from tests.attn_patterns.test_patterns import PATTERNS
from tests.train.helpers_train import assert_adapter_reproduces_probe
from tests.train.test_train_deepspeed import launch

pytestmark = pytest.mark.gpu



@pytest.mark.parametrize("name,params", PATTERNS, ids=[f"{n}{p or ''}" for n, p in PATTERNS])
def test_tiny_llama_trains_through_each_pattern(name, params):
    model = tiny_llama().cuda().to(torch.bfloat16).train()
    use_attention(model, name, **params)
    ids = torch.randint(3, 259, (2, 128), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_deepspeed_one_gpu_on_nccl(tmp_path):
    """With CUDA present the run initialises NCCL (sparse_ft.train.distributed) and trains on
    the GPU with DeepSpeed's FusedAdam; its adapter reloads (on CPU) to the probe's logits."""
    out = tmp_path / "ds"
    launch(out, tmp_path / "cache", gpus=1)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 4
    assert_adapter_reproduces_probe(out)
