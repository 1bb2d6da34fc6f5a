"""Negative log-likelihood of a batch of windows without ever holding a (tokens × vocabulary)
logit tensor for the whole window: the backbone runs once, the output head in chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_ft.modeling.attention import pretrained

CHUNK = 1024  # logit rows (batch × positions) at once: 1024 × 32k vocabulary in fp32 = 128 MB


def _backbone_and_head(model: torch.nn.Module):
    base = pretrained(model)
    return base, base.get_decoder(), base.get_output_embeddings()


@torch.inference_mode()
def window_nll(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, first: int, *, last: int,
               chunk: int = CHUNK) -> torch.Tensor:
    """Per-prediction NLL (fp32) of input positions ``[first, last)`` (relative to the window),
    whose targets are ``targets`` of shape ``(B, last - first)``."""
    base, decoder, head = _backbone_and_head(model)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    softcap = getattr(base.config, "final_logit_softcapping", None)
    out = []
    chunk = max(1, chunk // input_ids.shape[0])
    for start in range(first, last, chunk):
        stop = min(start + chunk, last)
        logits = head(hidden[:, start:stop]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        tgt = targets[:, start - first : stop - first]
        out.append(F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none"))
    return torch.cat(out, dim=1)
