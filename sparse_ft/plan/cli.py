"""``sparse-ft plan recipe=NAME [key=value ...] --gpu-memory 80GiB``: a recipe's predicted peak
memory per GPU by component, and the longest sequence that fits, per pattern and
sequence-parallel size (``sparse_ft.plan.memory``). Nothing is loaded but the model's config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

HELP = "predict peak GPU memory of a recipe by component and the longest context that fits"
PATTERNS = "full,s2,scca_fixed,scca_flow,longmixed,sda"
UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def memory_size(text: str) -> float:
    """``80GiB``, ``141GB``, ``24gib``: bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r} must be a positive size such as 80GiB, 141GB or 24GiB "
                         f"(units: {', '.join(u for u in UNITS if u)})")
    return float(found.group(1)) * UNITS[found.group(2).lower()]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} must be a comma list of positive integers")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignments", nargs="*", metavar="recipe=NAME | KEY=VALUE",
                        help="the recipe and dotted.key=value overrides, as sparse-ft train takes them")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (comma list: one column each)")
    parser.add_argument("--patterns", default=PATTERNS, help="patterns to plan (comma list); chunks from the recipe")
    parser.add_argument("--sp", default=None, help="sequence-parallel sizes (comma list; default: the recipe's train.sequence_parallel_size)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs the run spans (ZeRO's partitions; default: the largest --sp)")
    parser.add_argument("--kernel", choices=["fused", "math"], default="fused",
                        help="attention kernel: fused (flash / memory-efficient: no scores held) or math (fp32 scores)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of the GPU kept free for the CUDA context, NCCL and fragmentation")
    parser.add_argument("--lengths", default=None,
                        help="sequence lengths to break down by component (comma list; default: model.target_length)")
    parser.add_argument("--output", type=Path, default=None, help="write the plan as JSON here and markdown beside it (default: the table on stdout only)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier --output of sparse-ft")
    parser.set_defaults(func=run, local_rank=None)


def setup_from_recipe(recipe: Any, **changes: Any):
    """The planner's view of a loaded recipe (``sparse_ft.config.Recipe``)."""
    from sparse_ft.config.deepspeed_file import read_deepspeed_config
    from sparse_ft.plan.geometry import model_shape
    from sparse_ft.plan.memory import Setup

    ds = read_deepspeed_config(recipe.deepspeed) if recipe.deepspeed else {}
    zero = ds.get("zero_optimization", {}) if ds else {}
    offload = zero.get("offload_optimizer", {}) or {}
    train = recipe.train
    setup = Setup(
        shape=model_shape(recipe.model.name_or_path, trust_remote_code=recipe.model.trust_remote_code),
        dtype=recipe.model.dtype, quantization=recipe.model.quantization, lora_r=recipe.lora.r,
        lora_targets=tuple(recipe.lora.target_modules), extra_trainable=tuple(recipe.lora.extra_trainable),
        gradient_checkpointing=train.gradient_checkpointing, offload_activations=train.offload_activations,
        mlp_tile_tokens=train.mlp_tile_tokens, loss=train.loss, loss_chunk_tokens=train.loss_chunk_tokens,
        zero_stage=int(zero.get("stage", 0)) if ds else 0, offload_optimizer=offload.get("device", "none") not in ("none", None),
        world_size=max(1, train.sequence_parallel_size), sequence_parallel=train.sequence_parallel_size,
        pattern=recipe.attention.pattern, chunks=int(recipe.attention.params.get("chunks", 4)),
        batch=train.per_device_batch_size,
    )
    return dataclasses.replace(setup, **changes)


def run(args: argparse.Namespace) -> int:
    from sparse_ft.config import load_recipe
    from sparse_ft.files.outputs import check_output_file
    from sparse_ft.plan import memory
    from sparse_ft.train.cli import recipe_arguments

    budgets = {text.strip(): memory_size(text) for text in args.gpu_memory.split(",") if text.strip()}
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom={args.headroom} must be in [0, 1)")
    patterns = [p for p in args.patterns.split(",") if p]
    name, overrides = recipe_arguments(args)
    recipe = load_recipe(name, overrides)
    sps = _ints(args.sp, "--sp") if args.sp else [recipe.train.sequence_parallel_size]
    gpus = args.gpus or max(sps)
    if any(gpus % sp for sp in sps):
        raise ValueError(f"--gpus={gpus} must be a multiple of every --sp ({args.sp})")
    lengths = _ints(args.lengths, "--lengths") if args.lengths else [recipe.model.target_length]
    if args.output is not None:
        check_output_file(args.output, "plan: --output", args.overwrite)
        check_output_file(args.output.with_suffix(".md"), "plan: --output", args.overwrite)
    base = setup_from_recipe(recipe, kernel=args.kernel, world_size=gpus)
    fits = []
    for pattern in patterns:
        for sp in sps:
            setup = dataclasses.replace(base, pattern=pattern, sequence_parallel=sp)
            fits.append({"pattern": pattern, "sequence_parallel": sp, "longest": {
                label: memory.longest_fit(setup, budget * (1 - args.headroom)) for label, budget in budgets.items()}})
    breakdown = [{"seq_len": n, "components_gib": {k: v / memory.GIB for k, v in memory.components(base, n).items()},
                  "total_gib": memory.peak(base, n) / memory.GIB, "host_offload_gib": memory.host_offload(base, n) / memory.GIB}
                 for n in lengths]
    title = (f"sparse-ft plan: {recipe.name} ({base.shape.source}; {base.dtype}"
             f"{', NF4 base' if base.quantization == 'nf4' else ''}; ZeRO-{base.zero_stage} over {gpus} GPU(s); "
             f"{args.kernel} attention kernel; {args.headroom:.0%} of each GPU kept free). Predictions, not measurements.")
    table = markdown(fits, breakdown, list(budgets), base.pattern)
    print(f"{title}\n\n{table}")
    if args.output is not None:
        _write(args, title, table, {"recipe": recipe.name, "setup": _jsonable(base), "gpu_memory": budgets,
                                    "headroom": args.headroom, "longest_fit": fits, "breakdown": breakdown})
    return 0


def markdown(fits: list[dict], breakdown: list[dict], labels: list[str], pattern: str) -> str:
    lines = ["| pattern | sp | " + " | ".join(f"longest on {b}" for b in labels) + " |",
             "|---|---:|" + "---:|" * len(labels)]
    for row in fits:
        cells = [f"{n:,}" if n else "none" for n in row["longest"].values()]
        lines.append(f"| {row['pattern']} | {row['sequence_parallel']} | " + " | ".join(cells) + " |")
    for part in breakdown:
        lines += ["", f"Peak per GPU at {part['seq_len']:,} tokens ({pattern}), GiB:", "", "| component | GiB |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in part["components_gib"].items()]
        lines.append(f"| **total** | **{part['total_gib']:.2f}** |")
        if part["host_offload_gib"]:
            lines.append(f"| (host memory: offloaded checkpoints) | {part['host_offload_gib']:.2f} |")
    return "\n".join(lines)


def _jsonable(setup) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(setup), default=str))


def _write(args: argparse.Namespace, title: str, table: str, payload: dict) -> None:
    from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file, markdown_marker

    command = getattr(args, "command_line", None)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(args.output) as f:
        f.write(json.dumps({OUTPUT_FIELD: "sparse-ft plan", "command": command, **payload}, indent=2) + "\n")
    with atomic_file(args.output.with_suffix(".md")) as f:
        f.write(f"{title}\n\nCommand: `{command}`\n\n{table}\n\n{markdown_marker('sparse-ft plan')}\n")
