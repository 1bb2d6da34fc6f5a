"""The longest sequence one QLoRA training step of an 8B-geometry model fits on this GPU,
measured, beside the memory planner's prediction (issue 24).

    python scripts/fit_length.py --lengths 131072,196608,206848,217088 --output results/bench/fit-8b-h200.json

The model has Llama-3.1-8B's shapes and random weights (``sparse_ft.bench.models``' ``8b``),
written once in bf16 and loaded as ``sparse-ft train`` loads a recipe's base
(``recipes/qlora/llama2_7b_64k_24gb_qlora.yaml``: NF4 base, LoRA+, gradient checkpointing, the
chunked loss, the MLP in 8k-token tiles, SCCA flow over 4 chunks, with ``--keys`` over it).
Offloading is off by default: the checkpointed inputs would need 0.5 MiB of host memory per
token (fp32 residual stream, 32 layers of 4096), more than a 128 GiB host holds past ~200k.

As ``scripts/plan_check.py`` measures: AdamW steps once at 16 tokens so that its state exists,
then one step per length in increasing order (gradients accumulate, as under gradient
accumulation), each from a reset peak; the peak is torch.cuda.max_memory_allocated. The first
length that runs out of memory ends the sweep. Beside each: the planner's peak at that length,
and its longest fit on this GPU's whole memory (no headroom), for the same recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WRITER = "scripts/fit_length.py"
RECIPE = "qlora/llama2_7b_64k_24gb_qlora"
GIB = 2**30


def write_model(directory: Path, max_length: int, layers: Optional[int]) -> Path:
    """The 8b bench model, built on the GPU in bf16 (an 8B model built on a CPU in fp32 first
    would take longer than the measurement) and saved as an ordinary checkpoint."""
    import torch

    from sparse_ft.bench import models
    from sparse_ft.modeling.tiny import tiny_tokenizer

    model = models.build("8b", max_length, torch.device("cuda"), torch.bfloat16, layers=layers)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def planner_terms(setup, n: int) -> dict[str, float]:
    """The planner's peak at ``n`` tokens by named term, in GiB: what a measured breakdown is set beside."""
    from sparse_ft.plan import memory

    return {name: size / GIB for name, size in memory.components(setup, n).items()}


def recorded(step) -> dict:
    """The step under the allocator's history; a failure of the recording itself (not an
    out-of-memory) is kept as the breakdown's error, and the caller measures a plain step instead."""
    import torch

    from sparse_ft.bench.memory_snapshot import record_peak

    errors = []
    for stacks in ("python", "all"):  # Python stacks failed inside the checkpoint's recomputation once (H200, torch 2.11)
        try:
            return {**record_peak(step, stacks=stacks), "failed": errors}
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001  torch's recorder, not the step, is on trial here
            errors.append(f"stacks={stacks}: {type(err).__name__}: {err}")
            print(f"fit_length: the allocator history failed with {errors[-1]}", file=sys.stderr, flush=True)
    return {"error": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", required=True, help="sequence lengths, tried in increasing order (comma list)")
    parser.add_argument("--keys", default="", help="recipe overrides over the QLoRA recipe (space-separated key=value)")
    parser.add_argument("--layers", type=int, default=None,
                        help="cut the model to this many layers (default: all 32); the peak past the stored layer inputs is one layer's")
    parser.add_argument("--snapshot", type=int, default=None, metavar="N",
                        help="at length N, record the allocator's history during the step and name what is alive at "
                             "its peak (sparse_ft/bench/memory_snapshot.py), into the JSON")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    if args.output is not None:
        from sparse_ft.files.outputs import check_output_file

        for path in (args.output, args.output.with_suffix(".md")):
            check_output_file(path, "fit_length: --output", args.overwrite)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fit_length: needs a CUDA device (it measures what fits on one)")
    from sparse_ft.bench.machine import describe
    from sparse_ft.bench.recipe_step import recipe_step
    from sparse_ft.config import load_recipe
    from sparse_ft.plan import memory
    from sparse_ft.plan.cli import setup_from_recipe

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sparse-ft-fit-") as tmp:
        started = time.perf_counter()
        model_dir = write_model(Path(tmp) / "model", 8192, args.layers)
        overrides = [f"model.name_or_path={model_dir}", f"model.target_length={lengths[-1]}",
                     "train.offload_activations=false", *args.keys.split()]
        recipe = load_recipe(RECIPE, overrides)
        setup = setup_from_recipe(recipe)
        model, step = recipe_step(recipe, model_dir, device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        step(16)
        optimizer.step()
        print(f"model built and loaded in {time.perf_counter() - started:.0f} s", flush=True)
        for n in lengths:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            breakdown = None
            try:
                if args.snapshot == n:
                    breakdown = recorded(lambda: step(n))
                if breakdown is None or "error" in breakdown:  # not recorded, or the recording failed: a plain step
                    torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    step(n)
                torch.cuda.synchronize()
                measured, seconds = torch.cuda.max_memory_allocated(), time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                measured, seconds = None, None
            rows.append({"seq_len": n, "predicted_gib": memory.peak(setup, n) / GIB,
                         "measured_gib": measured / GIB if measured is not None else None, "seconds": seconds,
                         "fits": measured is not None, "planner_terms_gib": planner_terms(setup, n),
                         **({"peak_breakdown": breakdown} if breakdown else {})})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "peak_breakdown"}), flush=True)
            for group in (breakdown or {}).get("groups", [])[:15]:
                print(f"  {group['bytes'] / GIB:7.2f} GiB in {group['blocks']:5d} blocks  {group['where']}", flush=True)
            if measured is None:
                break
    fitted = [r["seq_len"] for r in rows if r["fits"]]
    predicted = memory.longest_fit(setup, total)
    machine = describe(device)
    command = "python " + " ".join([f"scripts/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    title = (f"Longest QLoRA step of Llama-3.1-8B's shapes ({RECIPE} + {' '.join(overrides[1:])}; pattern "
             f"{recipe.attention.pattern}) on {machine}, {total / GIB:.1f} GiB: planner's longest fit {predicted or 0:,} tokens "
             f"(no headroom); longest measured to fit {max(fitted) if fitted else 0:,} of those tried")
    table = ["| N | predicted peak GiB | measured peak GiB | measured / predicted | s/step | fits |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = r["fits"]
        table.append(f"| {r['seq_len']:,} | {r['predicted_gib']:.1f} | {r['measured_gib']:.1f} | "
                     f"{r['measured_gib'] / r['predicted_gib']:.3f} | {r['seconds']:.1f} | yes |" if ok else
                     f"| {r['seq_len']:,} | {r['predicted_gib']:.1f} | OOM | – | – | no |")
    print(f"\n{title}\n\n" + "\n".join(table))
    if args.output:
        from sparse_ft.files.outputs import OUTPUT_FIELD, atomic_file, markdown_marker

        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(args.output) as f:
            f.write(json.dumps({OUTPUT_FIELD: WRITER, "machine": machine, "total_gib": total / GIB, "command": command,
                                "recipe": RECIPE, "overrides": overrides[1:], "predicted_longest": predicted,
                                "results": rows}, indent=2) + "\n")
        with atomic_file(args.output.with_suffix(".md")) as f:
            f.write(f"{title}\n\nCommand: `{command}`\n\n" + "\n".join(table) + f"\n\n{markdown_marker(WRITER)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
