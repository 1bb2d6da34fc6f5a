"""The chunked loss (``train.loss: chunked``) against the model's own: the same loss and the
same gradients of every trainable tensor (LoRA, embeddings, norms) to 1e-6 in fp32, for each
family's head (tied and untied embeddings, Gemma's soft-capping, Cohere's and Granite's
scaling) with masked labels; no operation of its step produces a tokens x vocabulary tensor,
where the model's own loss does; and a model whose logits are not its head's is refused."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_ft.modeling.families import FAMILIES, TINY_SHAPE
from sparse_ft.train.loss import ChunkedLoss, model_loss, training_loss

TOL = dict(atol=1e-6, rtol=1e-6)
# family -> (config class, model class, settings): heads that do more than a linear layer
HEADS = {
    "gemma2 (soft-capped, tied)": ("Gemma2Config", "Gemma2ForCausalLM",
                                   dict(head_dim=8, final_logit_softcapping=3.0, attn_implementation="eager")),
    "cohere (scaled, tied)": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25)),
    "granite (divided)": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=4.0)),
}


def with_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA+ as a recipe trains it, the LoRA B matrices non-zero so every gradient flows."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "norm"])
    model = get_peft_model(model, config).train()
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def family_model(name: str, **overrides) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name in FAMILIES:
        return with_adapters(FAMILIES[name].tiny_model(**overrides))
    config_class, model_class, settings = HEADS[name]
    config = getattr(transformers, config_class)(**{**TINY_SHAPE, **settings, **overrides})
    return with_adapters(getattr(transformers, model_class)(config))


def batch(vocab: int, rows: int = 2, tokens: int = 40) -> dict:
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :9] = -100  # a masked prompt
    labels[-1, 20:23] = -100
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model: torch.nn.Module, loss_function, data: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_function(model, model, data)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("mistral", {}), ("qwen2", {"tie_word_embeddings": True}),
    *((name, {}) for name in HEADS),
])
def test_chunked_loss_and_gradients_equal_the_models_own(name, overrides):
    model = family_model(name, **overrides)
    data = batch(model.config.vocab_size)
    want, want_grads = loss_and_grads(model, model_loss, data)
    got, got_grads = loss_and_grads(model, ChunkedLoss(chunk_tokens=7), data)  # 80 tokens: 12 chunks, the last short
    torch.testing.assert_close(got, want, **TOL)
    assert want_grads.keys() == got_grads.keys()
    assert any("lora_A" in n for n in got_grads) and any("embed_tokens" in n for n in got_grads)
    assert any("norm" in n for n in got_grads)
    for n in want_grads:
        assert want_grads[n].abs().max() > 0, n
        torch.testing.assert_close(got_grads[n], want_grads[n], **TOL, msg=n)


def test_shift_labels_of_a_ulysses_shard_are_taken_as_they_are():
    model = family_model("llama")
    data = batch(model.config.vocab_size)
    shifted = torch.nn.functional.pad(data["labels"], (0, 1), value=-100)[:, 1:].contiguous()  # as DeepSpeed shards them
    want = model(input_ids=data["input_ids"], labels=shifted, shift_labels=shifted).loss
    got = ChunkedLoss(chunk_tokens=16)(model, model, {"input_ids": data["input_ids"], "shift_labels": shifted})
    torch.testing.assert_close(got, want, **TOL)


class LargestOutput(TorchDispatchMode):
    """The most elements any operation produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["chunked", "model"])
def test_no_operation_of_a_chunked_step_produces_a_tokens_by_vocabulary_tensor(kind):
    vocab, tokens, chunk = 8192, 512, 32
    model = family_model("llama", vocab_size=vocab)
    data = batch(vocab, rows=1, tokens=tokens)
    loss_function = training_loss(model, kind, chunk)
    with LargestOutput() as seen:
        loss_function(model, model, data).backward()
    if kind == "model":  # what the measurement would see without chunks
        assert seen.largest >= tokens * vocab
    else:  # a chunk's logits (and the embeddings' gradient) are the largest
        assert seen.largest <= max(chunk * vocab, vocab * TINY_SHAPE["hidden_size"])
        assert seen.largest < tokens * vocab // 4


def test_a_model_whose_logits_are_not_its_heads_is_refused():
    from transformers import LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    model = Doubled(FAMILIES["llama"].tiny_config())
    with pytest.raises(ValueError, match=r"^recipe key train.loss='chunked' is invalid for Doubled: its logits are not"):
        ChunkedLoss(chunk_tokens=16)(model, model, batch(model.config.vocab_size))


def test_a_model_without_logits_to_keep_is_refused_before_training():
    from transformers import LlamaForCausalLM

    class Old(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None):
            return super().forward(input_ids=input_ids, labels=labels)

    model = Old(FAMILIES["llama"].tiny_config())
    with pytest.raises(ValueError, match=r"train.loss='chunked' is invalid for Old: .* use train.loss=model$"):
        training_loss(model, "chunked", 16)
    assert training_loss(model, "model", 16) is model_loss


@pytest.mark.gpu
def test_liger_fused_loss_on_cuda_equals_the_chunked_torch_loss():
    pytest.importorskip("liger_kernel")
    model = family_model("llama").cuda()
    data = {k: v.cuda() for k, v in batch(model.config.vocab_size).items()}
    want = model_loss(model, model, data)
    got = ChunkedLoss(chunk_tokens=16)(model, model, data)  # an nn.Linear head on CUDA: Liger's path
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
