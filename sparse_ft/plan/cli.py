"""``sparse-ft plan recipe=NAME [key=value ...] --gpu-memory 80GiB``: a recipe's predicted peak
memory per GPU by component, and the longest sequence that fits, per pattern and
sequence-parallel size (``sparse_ft.plan.memory``). Nothing is loaded but the model's config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Optional

HELP = "predict peak GPU memory of a recipe by component and the longest context that fits"
UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def memory_size(text: str) -> float:
    """``80GiB``, ``141GB``, ``24gib``: bytes. A bare number is refused: ``80`` would be 80 bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r} must be a positive size with a unit, such as 80GiB, 141GB or 24GiB "
                         f"(units: {', '.join(UNITS)})")
    return float(found.group(1)) * UNITS[found.group(2).lower()]


def memory_sizes(text: str) -> dict[str, float]:
    """``--gpu-memory``'s comma list, one column each, at least one."""
    sizes = {part.strip(): memory_size(part) for part in text.split(",") if part.strip()}
    if not sizes:
        raise ValueError(f"--gpu-memory {text!r} must list at least one size, such as 80GiB or 24GiB,141GB")
    return sizes


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} must be a comma list of positive integers")
    return values


def pattern_setups(text: Optional[str], recipe: Any, base: Any) -> list[Any]:
    """One Setup per ``--patterns`` name (default: every trainable one that builds with no
    parameters), refused in one line as ``train`` refuses ``attention.pattern``: an unknown
    name, a training-free method (``dca``, ``longheads``: there is no training step to plan),
    parameters the pattern refuses, or a head count it cannot split. The recipe's pattern keeps
    its ``attention.params``; another takes those of them its factory accepts (``chunks``)."""
    from sparse_ft import methods
    from sparse_ft.plan import memory

    allowed = methods.trainable_names()
    names = methods.names(lambda s: s.training) if text is None else [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--patterns {text!r} must list at least one pattern; allowed: {', '.join(allowed)}")
    setups = []
    for name in names:
        if name not in allowed:
            known = name in methods.names()
            why = "is a training-free method: there is no training step to plan" if known else "is unknown"
            raise ValueError(f"--patterns {name!r} {why}; allowed: {', '.join(allowed)}")
        accepted = _registry(name).parameters(name)
        params = (dict(recipe.attention.params) if name == recipe.attention.pattern
                  else {k: v for k, v in recipe.attention.params.items() if k in accepted})
        setup = dataclasses.replace(base, pattern=name, pattern_params=params)
        try:
            pattern = memory.attention_pattern(setup)
            if pattern is not None:
                pattern.check_heads(base.shape.heads)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--patterns {name!r}: {err}") from None
        setups.append(setup)
    return setups


def _registry(name: str):
    from attn_patterns import PATTERNS
    from sparse_ft.methods import METHODS

    return PATTERNS if name in PATTERNS else METHODS


def gpu_count(flag: Optional[int], recipe_gpus: Optional[int], sps: list[int]) -> tuple[int, str]:
    """The GPUs the plan spans and where the number came from, which the title says: ``--gpus``,
    else the recipe's ``train.gpus`` (the GPUs it is written for), else the largest ``--sp``."""
    if flag is not None:
        return flag, "--gpus"
    if recipe_gpus is not None:
        return recipe_gpus, "the recipe's train.gpus"
    return max(sps), "the largest --sp: the recipe sets no train.gpus"


def check_sequence_parallel(sps: list[int], gpus: int, shape: Any) -> None:
    """Each ``--sp`` by the rules ``train`` applies before anything loads (heads, K/V heads,
    GPUs), in one line naming the flag."""
    from sparse_ft.config.schema import sequence_parallel_rule

    for sp in sps:
        rule = sequence_parallel_rule(sp, gpus, shape.heads, shape.kv_heads)
        if rule is not None:
            raise ValueError(f"--sp {sp} is invalid: {rule}")


def check_lora_rank(lora: Any, shape: Any) -> None:
    """``lora.r`` by the rule ``train`` applies in its preflight, on the shape's projections."""
    from sparse_ft.config.bad_input import fail
    from sparse_ft.config.schema import lora_rank_rule

    layers = shape.linear_shapes()
    targets = {t.rsplit(".", 1)[-1] for t in lora.target_modules}
    rule = lora_rank_rule(lora.r, {name: sides for name, sides in layers.items() if name in targets})
    if rule is not None:
        fail("lora.r", lora.r, rule)


def check_rope_factor(shape: Any, native_length: Optional[int], lengths: dict[str, list[int]]) -> None:
    """Each length's RoPE factor by the rule ``train`` applies before loading
    (``rope.check_factor`` on ``rope.extension_factor``, over the context the shape's config
    states, or ``model.native_length`` as ``train`` takes it), in one line naming the key or
    flag (``lengths``: each one's lengths)."""
    from sparse_ft.config.bad_input import fail
    from sparse_ft.modeling import rope

    config = shape.rope_config()
    try:
        rope.set_native_length(config, native_length)
    except ValueError as err:
        fail("model.native_length", native_length, str(err))
    for key, values in lengths.items():
        for n in values:
            try:
                rope.check_factor(config, rope.extension_factor(config, n))
            except ValueError as err:
                if key.startswith("--"):
                    raise ValueError(f"{key} {n} is invalid: {err}") from None
                fail(key, n, str(err))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignments", nargs="*", metavar="recipe=NAME | KEY=VALUE",
                        help="the recipe and dotted.key=value overrides, as sparse-ft train takes them")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (comma list: one column each)")
    parser.add_argument("--patterns", default=None,
                        help="patterns to plan (comma list; default: every trainable one, full included); "
                             "parameters (chunks) from the recipe's attention.params")
    parser.add_argument("--sp", default=None,
                        help="sequence-parallel sizes (comma list; default: the recipe's train.sequence_parallel_size)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs the run spans (ZeRO's partitions; default: the recipe's train.gpus, else the largest --sp)")
    parser.add_argument("--kernel", choices=["fused", "math"], default="fused",
                        help="attention kernel: fused (flash / memory-efficient: no scores held) or math (fp32 scores)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of the GPU kept free for the CUDA context, NCCL and fragmentation")
    parser.add_argument("--lengths", default=None,
                        help="sequence lengths to break down by component (comma list; default: model.target_length)")
    parser.add_argument("--output", type=Path, default=None,
                        help="write the plan as JSON here and markdown beside it (default: the table on stdout only)")
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
    shape = model_shape(recipe.model.name_or_path, trust_remote_code=recipe.model.trust_remote_code, tiny=recipe.model.tiny)
    setup = Setup(
        shape=shape,
        dtype=recipe.model.dtype, quantization=recipe.model.quantization, lora_r=recipe.lora.r,
        lora_targets=tuple(recipe.lora.target_modules), extra_trainable=tuple(recipe.lora.extra_trainable),
        gradient_checkpointing=train.gradient_checkpointing, offload_activations=train.offload_activations,
        mlp_tile_tokens=train.mlp_tile_tokens, loss=train.loss, loss_chunk_tokens=train.loss_chunk_tokens,
        zero_stage=int(zero.get("stage", 0)) if ds else 0, offload_optimizer=offload.get("device", "none") not in ("none", None),
        world_size=max(1, train.sequence_parallel_size), sequence_parallel=train.sequence_parallel_size,
        pattern=recipe.attention.pattern, pattern_params=dict(recipe.attention.params),
        batch=train.per_device_batch_size, dense_layers=len(dense_layers(recipe.attention.dense_layers, shape.layers)),
        dense_tail=train.dense_final_fraction > 0,
    )
    return dataclasses.replace(setup, **changes)


def dense_layers(spec: Any, layers: int) -> list[int]:
    """``attention.dense_layers`` in a model of ``layers`` layers, by the rule ``train``
    applies in its preflight."""
    from sparse_ft.config.bad_input import fail
    from sparse_ft.methods import dense_layer_indices, dense_layers_rule

    rule = dense_layers_rule(spec, layers)
    if rule is not None:
        fail("attention.dense_layers", spec, rule)
    return dense_layer_indices(spec, layers)


def describe_dense(setup: Any) -> str:
    """Where the planned run attends fully, for the plan's title."""
    said = f"; full attention (causal) in {setup.dense_layers} of {setup.shape.layers} layers" if setup.dense_layers else ""
    if setup.dense_tail:
        said += "; a dense tail: the peak is the larger of the pattern's step and the all-dense step's"
    return said


def run(args: argparse.Namespace) -> int:
    from attn_patterns.checks import length_rule
    from sparse_ft.config import load_recipe
    from sparse_ft.files.outputs import check_output_file
    from sparse_ft.plan import memory
    from sparse_ft.train.cli import recipe_arguments

    budgets = memory_sizes(args.gpu_memory)
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom={args.headroom} must be in [0, 1)")
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus={args.gpus} must be a positive number of GPUs")
    name, overrides = recipe_arguments(args)
    recipe = load_recipe(name, overrides)
    sps = _ints(args.sp, "--sp") if args.sp else [recipe.train.sequence_parallel_size]
    gpus, source = gpu_count(args.gpus, recipe.train.gpus, sps)
    if any(gpus % sp for sp in sps):
        given = "--gpus" if source == "--gpus" else "the recipe's train.gpus"
        raise ValueError(f"{given}={gpus} must be a multiple of every --sp ({args.sp})"
                         + ("" if source == "--gpus" else "; --gpus overrides it"))
    base = setup_from_recipe(recipe, kernel=args.kernel, world_size=gpus)
    check_sequence_parallel(sps, gpus, base.shape)
    check_lora_rank(recipe.lora, base.shape)
    lengths = _ints(args.lengths, "--lengths") if args.lengths else [recipe.model.target_length]
    if length_rule(max(lengths)):  # the recipe's target_length was checked when it loaded
        raise ValueError(f"--lengths {max(lengths)} is invalid: {length_rule(max(lengths))}")
    check_rope_factor(base.shape, recipe.model.native_length,
                      {"model.target_length": [recipe.model.target_length], "--lengths": lengths if args.lengths else []})
    uneven = [n for n in lengths if n % base.sequence_parallel]
    if uneven:
        raise ValueError(f"--lengths {uneven[0]} must be a multiple of the recipe's train.sequence_parallel_size="
                         f"{base.sequence_parallel} (each rank holds seq_len / sp tokens)")
    setups = pattern_setups(args.patterns, recipe, base)
    if args.output is not None:
        check_output_file(args.output, "plan: --output", args.overwrite)
        check_output_file(args.output.with_suffix(".md"), "plan: --output", args.overwrite)
    fits = []
    for setup in setups:
        for sp in sps:
            sized = dataclasses.replace(setup, sequence_parallel=sp)
            fits.append({"pattern": setup.pattern, "sequence_parallel": sp, "longest": {
                label: memory.longest_fit(sized, budget * (1 - args.headroom)) for label, budget in budgets.items()}})
    breakdown = [{"seq_len": n, "components_gib": {k: v / memory.GIB for k, v in memory.components(base, n).items()},
                  "phases_gib": {k: v / memory.GIB for k, v in memory.phase_totals(base, n).items()},
                  "total_gib": memory.peak(base, n) / memory.GIB, "host_offload_gib": memory.host_offload(base, n) / memory.GIB}
                 for n in lengths]
    title = (f"sparse-ft plan: {recipe.name} ({base.shape.source}; {base.dtype}"
             f"{', NF4 base' if base.quantization == 'nf4' else ''}; ZeRO-{base.zero_stage} over {gpus} GPU(s) (from {source}); "
             f"{args.kernel} attention kernel{describe_dense(base)}; {args.headroom:.0%} of each GPU kept free). "
             "Predictions, not measurements.")
    table = markdown(fits, breakdown, list(budgets), base.pattern)
    print(f"{title}\n\n{table}")
    if args.output is not None:
        _write(args, title, table, {"recipe": recipe.name, "setup": _jsonable(base), "gpus_from": source, "gpu_memory": budgets,
                                    "headroom": args.headroom, "search_limit": memory.SEARCH_LIMIT, "longest_fit": fits,
                                    "breakdown": breakdown})
    return 0


def markdown(fits: list[dict], breakdown: list[dict], labels: list[str], pattern: str) -> str:
    from sparse_ft.plan.memory import SEARCH_LIMIT

    def cell(n: Optional[int]) -> str:
        return "none" if not n else f"> {SEARCH_LIMIT:,}" if n > SEARCH_LIMIT else f"{n:,}"

    lines = ["| pattern | sp | " + " | ".join(f"longest on {b}" for b in labels) + " |",
             "|---|---:|" + "---:|" * len(labels)]
    for row in fits:
        cells = " | ".join(map(cell, row["longest"].values()))
        lines.append(f"| {row['pattern']} | {row['sequence_parallel']} | {cells} |")
    for part in breakdown:
        lines += ["", f"Peak per GPU at {part['seq_len']:,} tokens ({pattern}), GiB:", "", "| component | GiB |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in part["components_gib"].items()]
        lines.append(f"| **total** | **{part['total_gib']:.2f}** |")
        if part["host_offload_gib"]:
            lines.append(f"| (host memory: offloaded checkpoints) | {part['host_offload_gib']:.2f} |")
        phases = ", ".join(f"{k} {v:.2f}" for k, v in part["phases_gib"].items())
        lines += ["", "Beyond the static memory, each candidate for the peak (GiB; the largest is counted above): "
                  f"{phases}."]
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
