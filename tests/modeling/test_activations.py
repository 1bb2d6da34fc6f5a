"""The activation keys give the plain step's loss and gradients to 1e-6 in fp32: checkpointed
layers whose inputs wait in CPU memory (``train.offload_activations``; on the CPU the copy is
the tensor itself, so the tests check that every layer went through it), and MLPs over tiles of
the sequence (``train.mlp_tile_tokens``, whose projections never see more than a tile), alone,
together and under gradient checkpointing; the keys are refused where they cannot apply."""

import pytest
import torch

from sparse_ft import methods
from sparse_ft.config import LoraSection, TrainSection
from sparse_ft.modeling.families import FAMILIES
from sparse_ft.train import activations
from sparse_ft.train.model_setup import add_adapters

TOL = dict(atol=1e-6, rtol=1e-6)
TOKENS, TILE = 64, 24  # three tiles, the last short


def model(*, checkpointing: bool, **train) -> torch.nn.Module:
    torch.manual_seed(0)
    base = FAMILIES["llama"].tiny_model()
    method, _ = methods.for_training("scca_flow", {"chunks": 4}, None, "float32")
    net = add_adapters(base, LoraSection(dropout=0.0), method, checkpointing).train()
    torch.manual_seed(1)
    for name, p in net.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return activations.reduce_activation_memory(net, TrainSection(gradient_checkpointing=checkpointing, **train))


def step(net: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    ids = torch.randint(0, net.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(2))
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def plain():
    return step(model(checkpointing=False))


def assert_same_step(got, want):
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **TOL, msg=name)


def test_offloaded_checkpoints_give_the_plain_steps_gradients(plain, monkeypatch):
    calls = []
    real = activations._offloaded
    monkeypatch.setattr(activations, "_offloaded", lambda *a: calls.append(a[2].device) or real(*a))
    net = model(checkpointing=True, offload_activations=True)
    assert_same_step(step(net), plain)
    layers = net.config.num_hidden_layers
    assert calls == [torch.device("cpu")] * layers  # every layer's input went through the CPU copy


@pytest.mark.parametrize("checkpointing,offload", [(False, False), (True, False), (True, True)])
def test_tiled_mlps_give_the_plain_steps_gradients(plain, checkpointing, offload):
    net = model(checkpointing=checkpointing, offload_activations=offload, mlp_tile_tokens=TILE)
    seen = []
    for name, module in net.named_modules():
        if name.endswith("mlp.down_proj"):
            module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-2]))
    assert_same_step(step(net), plain)
    # forward, then each tile recomputed in backward (a recomputed layer's recomputation stops
    # early, once it has what backward asked for): never more than a tile at once
    assert sorted(set(seen)) == [16, 24] and seen.count(24) >= 2 * seen.count(16) >= 4 * net.config.num_hidden_layers


def test_the_keys_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match=r"^recipe key train.offload_activations=True is invalid: the model has no "):
        activations.offload_checkpoints(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^recipe key train.mlp_tile_tokens=8 is invalid: .* no decoder modules named mlp"):
        activations.tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)), 8)


@pytest.mark.gpu
def test_offloaded_checkpoints_hold_less_gpu_memory():
    def peak(**train) -> int:
        net = model(checkpointing=True, **train).cuda()
        ids = torch.randint(0, net.config.vocab_size, (1, 4096), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        net(input_ids=ids, labels=ids).loss.backward()
        return torch.cuda.max_memory_allocated()

    assert peak(offload_activations=True) < peak()
