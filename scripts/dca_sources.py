"""Each DCA variant against its source's formulas, reproduced here densely: max |logit diff|.

The sources (file and commit in docs/dca.md) are re-written below as plain dense attention
from their own position tables and scaling, independent of ``attn_patterns.dca``:

* ``paper``: eqs. 2–8 — keys at ``j mod s``; queries at ``i mod s`` (same chunk), ``s + a``
  if ``a < w`` else ``c − 1`` (previous chunk), ``c − 1`` (earlier chunks). No scaling.
* ``chunkllama`` (``chunkllama_attn_replace.py``) and ``qwen`` (vLLM / SGLang
  ``DualChunkRotaryEmbedding`` + ``dual_chunk_flash_attn``): with ``L = chunk_size −
  local_size``, tables ``q_t = t``, ``qc_t = min(t + L, chunk_size)`` for ``t < L`` and
  ``k_t = j mod L``; same chunk: ``q_t[i mod L]``, previous chunk: ``qc_t[i mod L]``, earlier
  chunks: ``qc_t[L − 1]``. Scaling over a sequence of N tokens: ChunkLlama multiplies its
  cos/sin tables, hence q and k, by ``1 + 0.05 ln(N/c)`` when ``N > c`` (``get_mscale``);
  the engines multiply the keys they cache and the softmax scale by
  ``max(1, 0.1 ln(N/c) + 1)`` with ``c = original_max_position_embeddings``.

Our DCA runs inside a tiny random model (2 layers, 8 heads on 2 KV heads) and is compared,
logit for logit, with the same model running the reference as its attention function; with
``--base`` inside a pretrained model (the committed tiny base, c = 256) on this file's bytes,
where the rows without the logit scale show what leaving it out costs.

    .venv/bin/python scripts/dca_sources.py                          # random tiny models, c = 64
    .venv/bin/python scripts/dca_sources.py --base assets/tiny-base --lengths 256,512,1024
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparse_ft.modeling.attention import install_method  # noqa: E402
from sparse_ft.methods import Method, get  # noqa: E402

C = 64  # pretraining length (original_max_position_embeddings) of the tiny models
QWEN_DCA = {"chunk_size": 64, "local_size": 16, "original_max_position_embeddings": C}
SLOPES = {"chunkllama": 0.05, "qwen": 0.1}


def _rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of x (..., N, D) at positions pos (N,), fp64."""
    angle = pos.double()[:, None] * inv_freq.double()
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((angle.sin(),) * 2, -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def source_tables(variant: str, n: int, s: int, w: int, c: int) -> tuple[torch.Tensor, ...]:
    """``(key_pos, q_same, q_prev, q_earlier, chunk)``: each (n,) from the source's tables."""
    i = torch.arange(n)
    if variant == "paper":
        a = i % s
        return a, a, torch.where(a < w, s + a, torch.full_like(a, c - 1)), torch.full_like(a, c - 1), i // s
    L = s - w
    q_t, qc_t = torch.arange(L), (torch.arange(L) + L).clamp(max=s)
    return i % L, q_t[i % L], qc_t[i % L], qc_t[L - 1].expand(n), i // L


def source_factor(variant: str, n: int, c: int) -> tuple[float, float]:
    """``(on q, on k)``: ChunkLlama scales both through its cos/sin; the engines scale the
    cached keys and the softmax scale (the same as scaling q)."""
    if variant == "paper" or n <= c:
        return 1.0, 1.0
    m = 1.0 + SLOPES[variant] * math.log(n / c)
    return m, m


class SourceDCA(Method):
    """The source's DCA as a dense attention function: q and k un-rotated from their true
    positions, re-rotated at the source's table positions, one logit matrix per kind of key."""

    name = "source_dca"

    def __init__(self, variant: str, s: int, w: int, c: int, inv_freq: torch.Tensor) -> None:
        self.variant, self.s, self.w, self.c, self.inv_freq = variant, s, w, c, inv_freq

    def __call__(self, module, query, key, value, attention_mask, scaling: Optional[float] = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        n = key.shape[2]
        if query.shape[2] != n:
            raise ValueError("the reference computes whole sequences only")
        pos = torch.arange(n)
        q, k = _rotate(query.double(), -pos, self.inv_freq), _rotate(key.double(), -pos, self.inv_freq)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
        key_pos, q_same, q_prev, q_earlier, chunk = source_tables(self.variant, n, self.s, self.w, self.c)
        fq, fk = source_factor(self.variant, n, self.c)
        k_at = _rotate(k, key_pos, self.inv_freq) * fk
        d = chunk[:, None] - chunk[None, :]
        logits = torch.zeros(*q.shape[:2], n, n, dtype=torch.float64)
        for kind, q_pos in ((d == 0, q_same), (d == 1, q_prev), (d > 1, q_earlier)):
            logits = torch.where(kind, (_rotate(q, q_pos, self.inv_freq) * fq) @ k_at.transpose(-1, -2), logits)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights = torch.softmax((logits * scaling).masked_fill(~causal, float("-inf")), -1)
        return (weights @ v).to(query.dtype).transpose(1, 2).contiguous(), None


def tiny_qwen(max_position_embeddings: int = 1024, dca: Optional[dict] = None, seed: int = 0):
    """A tiny Qwen2 carrying a small ``dual_chunk_attention_config`` (chunk 64, local 16,
    original length 64): Qwen2.5-1M's layout at 1/4096 scale."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         rope_theta=10000.0, tie_word_embeddings=False,
                         dual_chunk_attention_config=QWEN_DCA if dca is None else dca)
    return Qwen2ForCausalLM(config).eval()


def model_for(variant: str, base: Optional[str] = None):
    """``(model, (s, w, c))``. Random: the tiny Llama (c = 64) for paper and ChunkLlama at
    their defaults, the tiny Qwen2 with its config for qwen. ``base``: that model, given for
    qwen a config in Qwen2.5-1M's proportions (chunk_size = c, local_size = c/32)."""
    from sparse_ft.modeling.tiny import tiny_llama

    if base is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base).eval()
        c = int(model.config.max_position_embeddings)
        if variant == "qwen":
            model.config.dual_chunk_attention_config = {"chunk_size": c, "local_size": c // 32,
                                                        "original_max_position_embeddings": c}
            return model, (c, c // 32, c)
    elif variant == "qwen":
        return tiny_qwen(), (QWEN_DCA["chunk_size"], QWEN_DCA["local_size"], C)
    else:
        model, c = tiny_llama(max_position_embeddings=C), C
    s = 3 * c // 4
    return model, (s, c - s if variant == "paper" else c // 8, c)


@torch.no_grad()
def agreement(variant: str, n: int, base: Optional[str] = None, **params: Any) -> float:
    """Max |logit diff| between our ``dca`` (the variant, read from the model's config for
    qwen) and the source's formulas, over n tokens (random ids; this file's bytes with ``base``)."""
    model, (s, w, c) = model_for(variant, base)
    if base is None:
        ids = torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(0))
    else:  # byte-level vocabulary: 3 special ids, then the 256 bytes
        data = (Path(__file__).read_bytes() * (1 + n // 1000))[:n]
        ids = torch.tensor([[b + 3 for b in data]])
    install_method(model, SourceDCA(variant, s, w, c, model.model.rotary_emb.inv_freq))
    want = model(input_ids=ids).logits.double()
    ours = get("dca", **params) if variant == "qwen" else get("dca", variant=variant, **params)
    install_method(model, ours)
    return float((model(input_ids=ids).logits.double() - want).abs().max())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,128,256,512", help="sequence lengths")
    parser.add_argument("--base", default=None, help="a pretrained byte-level model (default: random tiny models)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    print("| variant | source | " + " | ".join(f"N = {n}" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    rows = [("paper", "eqs. 2–8", {}), ("chunkllama", "ChunkLlama formulas", {}),
            ("chunkllama", "ChunkLlama formulas, ours without logit_scale", {"logit_scale": "none"}),
            ("qwen", "vLLM / SGLang formulas", {}),
            ("qwen", "vLLM / SGLang formulas, ours without logit_scale", {"logit_scale": "none"})]
    for variant, source, params in rows:
        cells = [f"{agreement(variant, n, args.base, **params):.2e}" for n in lengths]
        print(f"| {variant} | {source} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
