"""The training loss without the full logits (``train.loss: chunked``, the default).

A causal LM's own loss projects every token onto the whole vocabulary and keeps that tensor for
backward: at 64k tokens and Llama-3's 128,256-token vocabulary, 33 GB in fp32 before its
gradient, more than the 8B model. Here the model runs with ``logits_to_keep=1`` (one token's
logits), its final hidden states are taken from its decoder, and the output head with the
cross-entropy runs over ``train.loss_chunk_tokens`` tokens at a time, each chunk checkpointed:
its logits are freed once its loss is summed and recomputed in backward. The head is called
as a module, so PEFT wrappers (LoRA on ``lm_head``, ``modules_to_save``), tied embeddings
and ZeRO-3's gather hooks apply as in the model's own forward. What some families do to the
logits after the head (Gemma's final soft-capping, Cohere's and Granite's scaling, Falcon-H1's
multiplier) is read from the config, and the first step compares the head's result with the
logits the model returned for its last token, so a family that does something else is
refused by name instead of training on another loss.

On CUDA, with Liger-Kernel installed (the ``liger`` extra), an unwrapped, unpartitioned head
goes through its fused linear cross-entropy instead, which never holds a chunk's logits for
backward either.
"""

from __future__ import annotations

import inspect
from functools import partial
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100

# forward: the model as the engine calls it (a DeepSpeed engine or the module); model: the module
LossFunction = Callable[[Callable[..., Any], nn.Module, dict], torch.Tensor]


def model_loss(forward: Callable[..., Any], model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's own mean token loss (``train.loss: model``): the full logits, held."""
    return forward(**batch).loss


def training_loss(model: nn.Module, kind: str, chunk_tokens: int) -> LossFunction:
    """``train.loss`` for ``model`` as the engines call it: the micro-batch's mean loss over
    its labelled tokens; a model the chunked loss cannot take apart is refused in one line."""
    if kind == "model":
        return model_loss
    check_chunked_loss(model)
    return ChunkedLoss(chunk_tokens)


def shifted_labels(batch: dict) -> torch.Tensor:
    """The label each position predicts: ``shift_labels`` where the batch holds them (a
    Ulysses shard, already shifted), else ``labels`` moved one left with the last position
    ignored, as transformers' ``ForCausalLMLoss`` shifts them."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"], (0, 1), value=IGNORE)[..., 1:]


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the family's causal-LM head does to ``lm_head``'s output before the loss."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divisor = getattr(config, "logits_scaling", None)
    multiplier = getattr(config, "lm_head_multiplier", None)

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divisor is not None:
            logits = logits / divisor
        if multiplier is not None:
            logits = logits * multiplier
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def _chunk_loss_sum(head: nn.Module, transform: Callable, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with _gathered(head):
        logits = transform(head(hidden)).float()  # upcast as the model's own loss does
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


class ChunkedLoss:
    """The mean token loss, ``chunk_tokens`` tokens of the head at a time (module docstring)."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.checked = False  # the head's logits compared with the model's, on the first call

    def __call__(self, forward: Callable[..., Any], model: nn.Module, batch: dict) -> torch.Tensor:
        head, decoder = _head_and_decoder(model)
        labels = shifted_labels(batch).reshape(-1)
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        captured: list[torch.Tensor] = []
        hook = decoder.register_forward_hook(lambda _m, _a, out: captured.append(_last_hidden_state(out)))
        try:
            out = forward(**inputs, logits_to_keep=1)
        finally:
            hook.remove()
        hidden = captured[-1]
        transform = logit_transform(_config(model))
        if not self.checked:
            _check_head(model, transform, hidden, out.logits)
            self.checked = True
        flat = hidden.reshape(-1, hidden.shape[-1])
        tokens = (labels != IGNORE).sum()
        fused = _liger_loss_sum(head, flat, labels, _config(model))
        if fused is not None:
            return fused / tokens.clamp(min=1)
        total = flat.new_zeros((), dtype=torch.float32)
        # no check of recomputed metadata: ZeRO-3 re-partitions the head's weight once a recomputed chunk is done
        for start in range(0, flat.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            total = total + checkpoint(partial(_chunk_loss_sum, head, transform), flat[start:end], labels[start:end],
                                       use_reentrant=False, determinism_check="none")
        return total / tokens.clamp(min=1)


def check_chunked_loss(model: nn.Module) -> None:
    """Refuse, in one line, a model the chunked loss cannot take apart: no output head, no
    decoder to read hidden states from, or a forward without ``logits_to_keep``."""
    try:
        head, _ = _head_and_decoder(model)
    except (AttributeError, NotImplementedError, TypeError):
        head = None
    forward = getattr(_causal_lm(model), "forward", None)
    takes = forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    if head is None or not takes:
        raise ValueError(f"recipe key train.loss='chunked' is invalid for {type(_causal_lm(model)).__name__}: it needs "
                         "get_output_embeddings(), get_decoder() and a forward taking logits_to_keep; use train.loss=model")


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _config(model: nn.Module) -> Any:
    return _causal_lm(model).config


def _head_and_decoder(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    lm = _causal_lm(model)
    head, decoder = lm.get_output_embeddings(), lm.get_decoder()
    if not isinstance(head, nn.Module) or not isinstance(decoder, nn.Module) or decoder is lm:
        raise TypeError("no separate output head and decoder")
    return head, decoder


def _gathered(head: nn.Module) -> ContextManager:
    """ZeRO-3's partitioned head weights whole for the call: its hooks gather them in the
    forward, but not when a chunk is recomputed in backward."""
    params = [p for p in head.parameters() if hasattr(p, "ds_id")]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def _last_hidden_state(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _check_head(model: nn.Module, transform: Callable, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The head and the family's transform on the last hidden state give the logits the model
    returned for its last token (collective under ZeRO-3: every rank's first step runs it)."""
    head, _ = _head_and_decoder(model)
    with torch.no_grad():
        mine = transform(head(hidden[:, -1:].detach())).float()
    theirs = logits[:, -1:].detach().float()
    if not torch.allclose(mine, theirs, rtol=1e-3, atol=1e-3 * max(1.0, theirs.abs().max().item())):
        name = type(_causal_lm(model)).__name__
        raise ValueError(f"recipe key train.loss='chunked' is invalid for {name}: its logits are not its output head's "
                         f"(max difference {(mine - theirs).abs().max().item():.3g}); use train.loss=model")


def _liger_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, config: Any) -> Optional[torch.Tensor]:
    """Liger-Kernel's fused linear cross-entropy (summed) on CUDA, for a plain ``nn.Linear``
    head that ZeRO-3 does not partition and a family that only soft-caps; None otherwise."""
    scaled = any(getattr(config, key, None) is not None for key in ("logit_scale", "logits_scaling", "lm_head_multiplier"))
    if not hidden.is_cuda or type(head) is not nn.Linear or hasattr(head.weight, "ds_id") or scaled:
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum",
                                             softcap=getattr(config, "final_logit_softcapping", None))
    return fused(head.weight, hidden, labels, head.bias)
