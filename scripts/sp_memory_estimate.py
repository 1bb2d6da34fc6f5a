"""Per-GPU memory of a LoRA+ run under ZeRO-3 with gradient checkpointing and DeepSpeed Ulysses,
by arithmetic (an estimate, not a measurement): the table in docs/training.md.

    python scripts/sp_memory_estimate.py          # Llama-2-7B, 8 GPUs, 64k and 128k, sp = 1 and 8

Each rank holds N/sp tokens outside attention, so everything that scales with tokens (the
checkpointed layer inputs, one layer's recomputed activations, the logits) shrinks by sp; the
attention kernels (flash or SDPA's memory-efficient one: no N×N scores) hold O(N·D) per head
for H/sp heads, which is the same N/sp × hidden. Weights and optimizer state are ZeRO-3 shards.
"""

from __future__ import annotations

GIB = 2**30
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, params=6.74e9)
TRAINABLE = 32 * 4 * 8 * (4096 + 4096) + 32000 * 4096 + 65 * 4096  # LoRA r=8 on q/k/v/o, embed_tokens, norms
PREFETCH = 5e8  # zero3_bf16: stage3_prefetch_bucket_size parameters gathered at a time


def estimate(n: int, sp: int, gpus: int = 8, m: dict = LLAMA2_7B) -> dict[str, float]:
    """Bytes per GPU (bf16 activations and weights) by component, in GiB."""
    t = n // sp  # tokens a rank holds outside attention
    parts = {
        "weights (ZeRO-3 shard)": m["params"] * 2 / gpus,
        "gathered weights (prefetch)": PREFETCH * 2,
        "LoRA+ fp32 master, Adam, grads (shard)": TRAINABLE * 16 / gpus,
        "checkpointed layer inputs": m["layers"] * t * m["hidden"] * 2,
        # q, k, v, o, attention output, norm outputs and the MLP's gate, up, act: forward + gradients
        "one layer recomputed": (6 * m["hidden"] + 3 * m["ffn"]) * t * 2 * 2,
        "Ulysses exchange (q, k, v, out for H/sp heads)": 4 * n * (m["hidden"] // sp) * 2 if sp > 1 else 0,
        "logits, fp32 loss and its gradient": t * m["vocab"] * (2 + 4 + 4),
    }
    return {name: value / GIB for name, value in parts.items()}


def main() -> None:
    cases = [(65536, 1), (65536, 8), (131072, 1), (131072, 8)]
    tables = [estimate(n, sp) for n, sp in cases]
    print("| per GPU, GiB | " + " | ".join(f"{n // 1024}k, sp={sp}" for n, sp in cases) + " |")
    print("|---|" + "---|" * len(cases))
    for name in tables[0]:
        print(f"| {name} | " + " | ".join(f"{t[name]:.1f}" for t in tables) + " |")
    print("| **total** | " + " | ".join(f"**{sum(t.values()):.1f}**" for t in tables) + " |")
    # what the flash / memory-efficient kernels avoid: fp32 scores of 4 chunks (w = N/4) per head
    scores = [n * (n // 4) * (LLAMA2_7B["heads"] // sp) * 4 / GIB for n, sp in cases]
    print("\nscores a math-kernel fallback would materialise (fp32, chunks=4): "
          + ", ".join(f"{n // 1024}k sp={sp}: {x:.0f} GiB" for (n, sp), x in zip(cases, scores)))


if __name__ == "__main__":
    main()
