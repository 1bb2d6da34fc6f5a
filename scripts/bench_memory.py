"""Peak memory and tokens/s of a training step against sequence length: full attention and the
patterns, with and without each memory feature of issue 22 (chunked loss, offloaded checkpoints,
tiled MLP, NF4 base), as ratios against the plain full-attention step measured in the same run.

    OMP_NUM_THREADS=1 python scripts/bench_memory.py --lengths 1024,2048 --threads 1 \\
        --output results/bench/memory-cpu.json
    python scripts/bench_memory.py --device cuda --model 1b --lengths 8192,16384,32768 \\
        --output results/bench/memory-cuda.json                                  # scripts/gpu_bench.sh

Each configuration is a recipe (``recipes/tiny.yaml`` over a local copy of the bench model, with
the feature's keys), built as ``sparse-ft train`` builds it (``build_model``: LoRA+, gradient
checkpointing, the activation keys; ``load_base``: NF4) and stepped as the trainer steps
(``training_loss``, autocast over fp32 masters): forward and backward, no optimizer update. The
baseline is the plain step of a run before issue 22: full attention, gradient
checkpointing, the model's own loss. Memory: what the model and its states hold, and the
peak growth during the step, at the allocator: torch.cuda.max_memory_allocated on CUDA, the
profiler's memory events of torch's CPU allocator on a CPU (``sparse_ft.bench.machine.allocated``;
the resident size counts pages, not bytes: docs/memory.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WRITER = "scripts/bench_memory.py"


def feature_keys(tokens: int) -> dict[str, list[str]]:
    """The recipe keys of each configuration over the baseline's, loss chunks and MLP tiles of
    ``tokens`` (--chunk-tokens: 256 at CPU lengths, where the defaults, 2048-token loss chunks,
    would be the whole sequence; a GPU's are the recipes' own, thousands)."""
    chunked = ["train.loss=chunked", f"train.loss_chunk_tokens={tokens}"]
    tiles, offload, nf4 = f"train.mlp_tile_tokens={tokens}", "train.offload_activations=true", "model.quantization=nf4"
    return {"baseline (model loss)": [], "chunked loss": chunked, "chunked + offload": [*chunked, offload],
            "chunked + tiled MLP": [*chunked, tiles], "chunked + NF4": [*chunked, nf4],
            "all": [*chunked, offload, tiles, nf4]}


FEATURES = list(feature_keys(256))
BASELINE = ("full", "baseline (model loss)")
# the benchmark's models: the CPU one has the tiny model's widths with Llama-2's vocabulary, so
# that the loss weighs what it weighs at scale; 1b is sparse_ft.bench.models' GPU model
MODELS = {
    "tiny-v32k": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32000),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
}


def configurations(patterns: list[str], features: list[str]) -> list[tuple[str, str]]:
    return [BASELINE] + [(p, f) for f in features for p in patterns if (p, f) != BASELINE]


def step_function(model_dir: Path, pattern: str, keys: list[str], n: int, *, device: str, dtype: str):
    """The model of one configuration and a function running one training step of ``n`` tokens."""
    import torch

    from sparse_ft.bench.recipe_step import recipe_step
    from sparse_ft.config import load_recipe

    params = [] if pattern == "full" else ["attention.params.chunks=4"]
    recipe = load_recipe("tiny", [f"model.name_or_path={model_dir}", f"model.dtype={dtype}", f"model.target_length={n}",
                                  f"attention.pattern={pattern}", *params, "deepspeed=null", "train.loss=model",
                                  "train.gradient_checkpointing=true", *keys])
    model, step = recipe_step(recipe, model_dir, torch.device(device))

    def fresh_step() -> None:
        model.zero_grad(set_to_none=True)
        step(n)

    return model, fresh_step


def markdown(rows: list[dict]) -> str:
    lines = ["| N | pattern | keys | ms/step | tokens/s | model + states MiB | step peak MiB | peak MiB | "
             "tokens/s vs baseline | peak vs baseline |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['seq_len']} | {r['pattern']} | {r['keys']} | {ms:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['static_mib']:.0f} | {r['step_peak_mib']:.0f} | {r['peak_mib']:.0f} | {r['speed_ratio']:.2f}× | "
                     f"{r['memory_ratio']:.2f}× |" if ms is not None else
                     f"| {r['seq_len']} | {r['pattern']} | {r['keys']} | OOM | OOM | {r['static_mib']:.0f} | OOM | OOM | – | – |")
    return "\n".join(lines)


def write(output: Path, title: str, command: str, rows: list[dict], payload: dict) -> None:
    from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file, markdown_marker

    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(output) as f:
        f.write(json.dumps({OUTPUT_FIELD: WRITER, **payload, "command": command, "results": rows}, indent=2) + "\n")
    with atomic_file(output.with_suffix(".md")) as f:
        f.write(f"{title}\n\nCommand: `{command}`\n\n{markdown(rows)}\n\n{markdown_marker(WRITER)}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--patterns", default="full,scca_flow,s2,longmixed")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"comma list of: {', '.join(FEATURES)}")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per loss chunk and per MLP tile")
    parser.add_argument("--model", choices=list(MODELS), default="tiny-v32k")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on a CPU")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    features = [f for f in args.features.split(",") if f]
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise SystemExit(f"bench_memory: --features {unknown[0]!r} is unknown; allowed: {', '.join(FEATURES)}")
    if args.output is not None:
        from sparse_ft.files.outputs import check_output_file

        for path in (args.output, args.output.with_suffix(".md")):
            check_output_file(path, "bench_memory: --output", args.overwrite)
    import torch
    from tqdm import tqdm

    from sparse_ft.bench.machine import allocated, describe, held_bytes, measure
    from sparse_ft.modeling.model_io import materialize_tiny

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    configs = configurations([p for p in args.patterns.split(",") if p], features)
    keys = feature_keys(args.chunk_tokens)
    command = "python " + " ".join([f"scripts/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    machine = describe(device)
    title = (f"training step (forward+backward, LoRA+ as the recipes train, gradient checkpointing, batch 1, {dtype}) of "
             f"{args.model} ({MODELS[args.model]}), median of {args.repeats} after {args.warmup} warm-up, ratios against "
             f"full attention with the model's own loss in the same run, on {machine}; peak memory: "
             + ("torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch's CPU allocator (profiler memory events)"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sparse-ft-bench-memory-") as tmp:
        model_dir = materialize_tiny(Path(tmp) / "model", 0, **MODELS[args.model])
        bar = tqdm(total=len(lengths) * len(configs), desc="bench memory", unit="step")
        for n in lengths:
            base = None
            for pattern, feature in configs:
                gc.collect()
                build = lambda: step_function(model_dir, pattern, keys[feature], n, device=str(device), dtype=dtype)  # noqa: E731
                if device.type == "cuda":
                    before = held_bytes(device)
                    model, step = build()
                    static = (held_bytes(device) - before) / 2**20
                    got = measure(step, device, args.warmup, args.repeats)
                else:  # time as measured; memory at torch's CPU allocator (the resident size is not it)
                    (model, step), _, static_bytes = allocated(build)
                    static = static_bytes / 2**20
                    timed = measure(step, device, args.warmup, args.repeats)
                    got = (timed[0], allocated(step)[1] / 2**20)
                del model, step
                gc.collect()
                ms, mib = got or (None, None)
                total = static + mib if mib is not None else None
                if (pattern, feature) == BASELINE:
                    base = (ms, total)
                rows.append({"seq_len": n, "pattern": pattern, "keys": feature, "ms": ms, "static_mib": static,
                             "step_peak_mib": mib, "peak_mib": total, "tokens_per_s": n / ms * 1e3 if ms else None,
                             "speed_ratio": base[0] / ms if ms and base and base[0] else None,
                             "memory_ratio": total / base[1] if total and base and base[1] else None})
                bar.update()
                if args.output:
                    write(args.output, title, command, rows, {"machine": machine, "device": str(device), "dtype": dtype,
                          "model": args.model, "model_config": MODELS[args.model], "complete": False})
        bar.close()
    if args.output:
        write(args.output, title, command, rows, {"machine": machine, "device": str(device), "dtype": dtype,
              "model": args.model, "model_config": MODELS[args.model], "complete": True})
    print(f"\n{title}\n\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
