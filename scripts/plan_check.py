"""The memory planner (``sparse-ft plan``) against measured peak memory of real training steps.

    OMP_NUM_THREADS=1 python scripts/plan_check.py                  # CPU: tiny and Llama-2-7B cut to 1 layer
    python scripts/plan_check.py --device cuda --cases gpu          # on a GPU (scripts/gpu_bench.sh)

Each measurement runs in a fresh subprocess (nothing an earlier one allocated can hide in its
heap): the model is built as a recipe builds it (LoRA+ through ``add_adapters``, the activation
keys, the chunked or the model's loss), AdamW takes one step at 16 tokens so its state exists,
then one step at N tokens warms up (its gradients stay, as under gradient accumulation) and the
next is measured. Two numbers are compared with the planner's: the static memory (weights,
trainable masters, their gradients, AdamW's m and v) and the step (the peak growth during
forward+backward: activations, and the new gradients before they are accumulated). CUDA: the allocator's counters
(torch.cuda.max_memory_allocated). CPU: the same quantity from torch's profiler, whose memory
events record every allocation and free of its CPU allocator. Not the resident size: it counts
pages touched, not bytes allocated. glibc kept the pages of the tiny model's freed 1 MiB
tensors in its heap (2.6x the live bytes), and a zeroed tensor written in a few rows (the
embedding's gradient: the rows of the tokens seen) or not yet written is not resident at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20
# Llama-2-7B's widths (sparse_ft/plan/geometry.py) cut to layers, vocabulary and all
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                 vocab_size=32000)
FEATURES = {  # name -> recipe train keys
    "ckpt": dict(gradient_checkpointing=True),
    "ckpt+tile+offload": dict(gradient_checkpointing=True, mlp_tile_tokens=256, offload_activations=True),
    "ckpt, model loss": dict(gradient_checkpointing=True, loss="model"),
    "no ckpt": dict(gradient_checkpointing=False),
}
CASES = {
    "cpu": [("llama2-7b", 1, "scca_flow", "ckpt", 1024)]
           + [("tiny", 4, p, "ckpt", 8192) for p in ("scca_flow", "full")]
           + [("tiny", 4, "scca_flow", "ckpt+tile+offload", 8192), ("llama2-7b", 1, "full", "ckpt", 1024)],
    "quick": [("tiny", 4, "scca_flow", "ckpt", 4096), ("llama2-7b", 1, "scca_flow", "ckpt", 1024)],
    "gpu": [("llama2-7b", 2, p, f, n) for f in ("ckpt", "ckpt+tile+offload") for p in ("full", "scca_flow", "s2")
            for n in (8192, 32768)],
}


def model_config(model: str, layers: int) -> dict:
    return dict(num_hidden_layers=layers, **({} if model == "tiny" else LLAMA2_7B))


def setup_for(model: str, layers: int, pattern: str, feature: str, *, dtype: str, device: str):
    """The planner's Setup of a measured case (plain torch, one process)."""
    from sparse_ft.modeling.tiny import tiny_llama_config
    from sparse_ft.plan.geometry import from_config
    from sparse_ft.plan.memory import Setup

    shape = from_config(tiny_llama_config(**model_config(model, layers)), model)
    keys = {"mlp_tile_tokens": 0, "offload_activations": False, "loss": "chunked", **FEATURES[feature]}
    if device == "cpu":  # offloading to the CPU from the CPU keeps the tensor itself
        keys["offload_activations"] = False
    params = {} if pattern == "full" else {"chunks": 4}
    return Setup(shape=shape, dtype=dtype, pattern=pattern, pattern_params=params, **keys)


def predicted(setup, n: int) -> tuple[float, float]:
    """(static, step) bytes as the measurement splits them: the static part holds weights,
    trainable masters, their gradients (kept from the warm-up step, as under gradient
    accumulation) and AdamW's state; the step what a step allocates on top."""
    from sparse_ft.plan import memory

    static = sum(memory.weights(setup).values()) + sum(memory.optimizer_state(setup).values())
    return static, memory.peak(setup, n) - static


def measure_child(spec: dict) -> dict:
    """One case, in this (fresh) process."""
    import gc

    import torch

    from sparse_ft import methods
    from sparse_ft.bench.machine import PeakMemory, allocated, held_bytes
    from sparse_ft.config import LoraSection, TrainSection
    from sparse_ft.modeling.tiny import tiny_llama_config
    from sparse_ft.train.activations import reduce_activation_memory
    from sparse_ft.train.loss import training_loss
    from sparse_ft.train.model_setup import add_adapters
    from transformers import AutoModelForCausalLM

    device = torch.device(spec["device"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    keys = {"mlp_tile_tokens": 0, "offload_activations": False, "loss": "chunked", **FEATURES[spec["feature"]]}
    train = TrainSection(**keys)
    method = methods.for_training(spec["pattern"], {"chunks": 4} if spec["pattern"] != "full" else {}, None,
                                  spec["dtype"])[0]
    def build(model_name: str, layers: int, n: int):
        torch.manual_seed(0)
        with torch.device(device):
            config = tiny_llama_config(max_position_embeddings=max(n, 256), use_cache=False,
                                       **model_config(model_name, layers))
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = add_adapters(model, LoraSection(), method, train.gradient_checkpointing)
        model = reduce_activation_memory(model.train(), train)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if dtype != torch.float32:
            for p in trainable:
                p.data = p.data.float()
        loss_fn = training_loss(model, train.loss, train.loss_chunk_tokens)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)

        def step(n: int) -> None:
            ids = torch.randint(0, config.vocab_size, (1, n), device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_fn(model, model, {"input_ids": ids, "labels": ids})
            loss.backward()

        step(16)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return model, trainable, step, optimizer

    build("tiny", 1, 64)  # loads the code every later step runs (lazy imports, kernels) before measuring
    gc.collect()
    if device.type == "cuda":
        before = held_bytes(device)
        model, trainable, step, optimizer = build(spec["model"], spec["layers"], spec["n"])
        step(spec["n"])
        static_bytes = held_bytes(device) - before
        peak = PeakMemory(device)
        with peak.measure():
            step(spec["n"])
        step_bytes = peak.mib * MIB
    else:
        (model, trainable, step, optimizer), _, built = allocated(lambda: build(spec["model"], spec["layers"], spec["n"]))
        _, _, gradients = allocated(lambda: step(spec["n"]))
        static_bytes = built + gradients
        _, step_bytes, _ = allocated(lambda: step(spec["n"]))
    static_mib, step_mib = static_bytes / MIB, step_bytes / MIB
    return {"static_mib": static_mib, "step_mib": step_mib,
            "trainable": sum(p.numel() for p in trainable)}


def measure(spec: dict) -> dict:
    """One case in a fresh subprocess."""
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if out.returncode:
        raise SystemExit(f"case {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", choices=list(CASES), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--output", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--measured", type=Path, default=None,
                        help="take the measurements from an earlier --output (the planner's predictions recomputed)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_child(json.loads(args.child))))
        return
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    rows = []
    print("| model | layers | pattern | keys | N | static pred MiB | static meas MiB | ratio | step pred MiB | "
          "step meas MiB | ratio |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    earlier = json.loads(args.measured.read_text())["rows"] if args.measured else None
    cases = [(r["model"], r["layers"], r["pattern"], r["feature"], r["n"]) for r in earlier] if earlier else CASES[args.cases]
    for index, (model, layers, pattern, feature, n) in enumerate(cases):
        spec = dict(model=model, layers=layers, pattern=pattern, feature=feature, n=n, device=args.device, dtype=dtype)
        got = ({k: earlier[index][k] for k in ("static_mib", "step_mib", "trainable")} if earlier
               else measure(spec))
        static, step = (x / MIB for x in predicted(setup_for(model, layers, pattern, feature, dtype=dtype, device=args.device), n))
        row = {**spec, "static_pred_mib": static, "step_pred_mib": step, **got,
               "static_ratio": static / got["static_mib"], "step_ratio": step / got["step_mib"]}
        rows.append(row)
        print(f"| {model} | {layers} | {pattern} | {feature} | {n} | {static:.0f} | {got['static_mib']:.0f} | "
              f"{row['static_ratio']:.2f} | {step:.0f} | {got['step_mib']:.0f} | {row['step_ratio']:.2f} |", flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"device": args.device, "dtype": dtype, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
