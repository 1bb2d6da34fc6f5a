#!/usr/bin/env bash
# Every GPU measurement of issues 30 and 36 on one lent H100 or H200, in three parts of under 10
# minutes each (one device call each), run from anywhere in the repository:
#
#   scripts/gpu_bench.sh part1   # machine and versions; every gpu-marked test (the Triton kernel's bf16
#                                # forward and backward for every pattern among them); attention 4k-128k
#                                # against the pinned dense kernel (sdpa and triton), then flex
#   scripts/gpu_bench.sh part2   # training steps (1B 16k-128k, Llama-3.1-8B shapes 32k-128k) with each
#                                # pattern's Amdahl bound; DCA and LongHeads prefill 8k-128k; NF4 eval vs bf16
#   scripts/gpu_bench.sh part3   # memory: the planner against the allocator (plan_check), a recorded
#                                # 8B-shaped QLoRA step at 131k and 180k (what is alive at its peak), the longest fit
#   scripts/gpu_bench.sh quick   # what a 15-minute lease affords (about 6 minutes): attention 16k-128k on sdpa
#                                # (the Triton kernel's rate is part1's), the Triton kernels' tests, DCA and LongHeads'
#                                # kernel 32k-128k, the 1B step at 64k
#   scripts/gpu_bench.sh rest    # what quick leaves out, in one call of under 10 minutes: the recorded 2-layer
#                                # QLoRA step, the 1B step 16k-32k of every pattern with its Amdahl bound, DCA and
#                                # LongHeads 8k-128k, the longest 8B QLoRA fit around the planner's, the other gpu tests
#
# Every step has its own time cap; a capped step keeps the rows it measured (the JSON says
# "complete": false). Results: results/bench/<name>-<gpu>.{json,md}, the machine in
# results/bench/machine-<gpu>.txt; with $OUT set (the device tool) the part's log is written there
# and, after every step, $OUT/results.tar holds every result file so far (a call cut short by its
# own limit still brings back what finished; one tar because a call brings back at most 8 files):
# `tar xf results.tar` in the repository root, then commit.
#
# Nothing is installed from the network. Needs python3 (or $PYTHON) with CUDA torch and what the
# device image has (accelerate, safetensors, pyyaml, tqdm, numpy, pyarrow, triton). The rest of
# the lock's versions travel as wheels in .git/info/exclude'd .whl/ (carried; this script installs
# any .whl/*.whl into a private temporary directory, ahead of the image's packages): on 2026-11-26 transformers 5.23.0,
# peft 0.21.2, datasets 5.2.0, dill, multiprocess, hjson, pydantic 2.14.3 + pydantic-core 2.50.4,
# annotated-types, typing-inspection, typing-extensions 4.16.0 (`python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d .whl
# NAME==VERSION`); bitsandbytes 0.50.2 with every libbitsandbytes_*.so but cuda130 and cpu deleted
# from the wheel (`zip -d`: 43 MB to 4 MB, under the 64 MiB a call carries); deepspeed 0.19.8 as the
# wheel `pip wheel --no-deps deepspeed==0.19.8` builds (it JIT-builds FusedAdam with the image's nvcc,
# ~1 min). flash-attn and liger-kernel are used only if they import (neither was carried).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$PART" in part1|part2|part3|quick|rest) ;; *) echo "usage: scripts/gpu_bench.sh part1|part2|part3|quick|rest" >&2; exit 2 ;; esac
# this run's own temporary directory (fixed names in the shared /tmp could be another user's, or
# another run's): the wheels are installed there and removed at exit; the log stays there when
# $OUT is unset (its path is printed)
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bench.XXXXXXXX") || exit 1
trap 'rm -rf "$SCRATCH/site"; rmdir "$SCRATCH" 2>/dev/null' EXIT  # kept only when the log is in it

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site" .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:$SCRATCH/site"
fi
GPU=$("$PY" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name().split()[1].lower())') \
    || { echo "scripts/gpu_bench.sh: no CUDA device for $PY" >&2; exit 1; }
# DeepSpeed 0.19 builds its optimizer ops from TORCH_CUDA_ARCH_LIST and cannot read arch-specific
# entries such as the Hopper images' 9.0a (the trainer refuses them by name): the plain arch instead
[ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g' <<<"$TORCH_CUDA_ARCH_LIST")
RES=results/bench
LOG=${OUT:-$SCRATCH}/gpu-$PART-$GPU.log
mkdir -p "$RES"
WROTE=()

step() {  # step CAP_SECONDS NAME COMMAND...: run with a cap, log, go on whatever happens
    local cap=$1 name=$2
    shift 2
    echo "== $name: $* (cap ${cap}s, $(date -u +%H:%M:%S))"
    timeout --signal=INT --kill-after=30 "$cap" "$@"
    echo "== $name: exit $?"
    keep
}

keep() {  # with $OUT set: every result file written so far into $OUT/results.tar, replaced atomically
    [ -n "${OUT:-}" ] || return 0
    local have=()
    for f in "${WROTE[@]}"; do [ -f "$f" ] && have+=("$f"); done
    [ ${#have[@]} -gt 0 ] && tar cf "$OUT/.results.tar" "${have[@]}" && mv "$OUT/.results.tar" "$OUT/results.tar"
}

bench() {  # bench CAP NAME ARGS...: sparse-ft bench ARGS --output results/bench/NAME-GPU.json
    local cap=$1 name=$2
    shift 2
    WROTE+=("$RES/$name-$GPU.json" "$RES/$name-$GPU.md")
    step "$cap" "$name" "$PY" -m sparse_ft bench "$@" --output "$RES/$name-$GPU.json" --overwrite  # a rerun replaces its own
}

imports() { "$PY" -c "import $1" 2>/dev/null; }

machine() {
    WROTE+=("$RES/machine-$GPU.txt")
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "|", torch.cuda.get_device_name(),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
for name in ("transformers", "peft", "accelerate", "triton", "flash_attn", "bitsandbytes"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")
EOF
    } | tee "$RES/machine-$GPU.txt"
    keep
}

gpu_tests() {  # gpu_tests CAP PYTEST-ARGS...: the gpu-marked tests, their record committed
    local cap=$1
    shift
    WROTE+=("$RES/gpu-tests-$GPU.txt")
    step "$cap" "gpu tests" "$PY" -m pytest -q -p no:cacheprovider -m gpu "$@" 2>&1 | tee "$RES/gpu-tests-$GPU.txt"
}

ATTN=(--dtype bf16 --heads 32 --kv-heads 8 --head-dims 128 --warmup 1 --repeats 5)

attention() {  # attention CAP LENGTHS: every pattern on sdpa and triton against the pinned dense kernel
    local backends=sdpa,triton
    imports flash_attn && backends=$backends,flash
    bench "$1" attention-h32-d128 attention "${ATTN[@]}" --lengths "$2" --backends "$backends"
}

train_1b() {  # train_1b CAP LENGTHS: the 1B step of every pattern beside full attention and its Amdahl bound
    bench "$1" train-1b train --model 1b --dtype bf16 --lengths "$2" --patterns s2,scca_fixed,scca_flow,sda,longmixed \
        --warmup 1 --repeats 3
}

recorded_fit() {  # recorded_fit CAP: the planner against a recorded QLoRA step of Llama-3.1-8B's widths cut to 2 layers
    WROTE+=("$RES/fit-8b-2layers-$GPU.json" "$RES/fit-8b-2layers-$GPU.md")
    step "$1" fit-8b-2layers "$PY" scripts/fit_length.py --layers 2 --lengths 131072,180224 --snapshot 180224 \
        --output "$RES/fit-8b-2layers-$GPU.json" --overwrite
}

part1() {
    machine
    gpu_tests 240 tests
    attention 150 4096,8192,16384,32768,65536,131072
    # FlexAttention compiles once for every length (dynamic shapes): the whole sweep
    bench 120 attention-h32-d128-flex attention "${ATTN[@]}" --lengths 8192,16384,32768,65536 --backends flex
}

part2() {
    train_1b 170 16384,32768,65536,131072
    bench 150 train-8b train --model 8b --dtype bf16 --lengths 32768,65536,131072 --patterns s2,scca_flow,longmixed \
        --warmup 1 --repeats 3
    bench 100 dca-prefill dca --dtype bf16 --lengths 8192,16384,32768,65536,131072 --heads 32 --kv-heads 8 --head-dim 128 \
        --pretraining-length 4096 --longheads --warmup 1 --repeats 5
    if imports bitsandbytes; then
        bench 120 eval-nf4 eval --model 1b --dtype bf16 --lengths 8192 --warmup 1 --repeats 3
    else
        echo "== eval-nf4: not run, bitsandbytes does not import (carry its wheel in .whl/, see the top of this file)"
    fi
}

part3() {
    WROTE+=("$RES/plan-check-$GPU.json" "$RES/plan-check-$GPU.md" "$RES/fit-8b-$GPU.json" "$RES/fit-8b-$GPU.md")
    step 150 plan-check "$PY" scripts/plan_check.py --device cuda --cases gpu --output "$RES/plan-check-$GPU.json" \
        | tee "$RES/plan-check-$GPU.md"
    recorded_fit 90
    # the planner's longest fit for this recipe on a 140 GiB H200 is 195,584 tokens; an H200 measured
    # 180,224 to fit and 196,608 not (results/bench/fit-8b-h200.md)
    step 300 fit-8b "$PY" scripts/fit_length.py --lengths 131072,180224,196608 --output "$RES/fit-8b-$GPU.json" --overwrite
}

quick() {
    machine
    bench 100 attention-h32-d128 attention "${ATTN[@]}" --lengths 16384,32768,65536,131072 --backends sdpa
    # 40 tests, about 120 s on an H200 (each fp32 ragged case compiles for 17-27 s): 110 s cut off 8
    gpu_tests 140 tests/attn_patterns/test_triton_attention.py tests/attn_patterns/test_dca_triton.py tests/attn_patterns/test_longheads_triton.py \
        tests/bench/test_memory_snapshot.py
    # LongHeads through its one kernel (the torch path: dca-prefill-h100.md)
    bench 60 dca-prefill-longheads-triton dca --dtype bf16 --lengths 32768,65536,131072 --heads 32 --kv-heads 8 \
        --head-dim 128 --pretraining-length 4096 --longheads-backend triton --warmup 1 --repeats 5
    # 20 steps of 1-4 s after the model is built: 70 s was too short on an H200
    bench 150 train-1b-64k train --model 1b --dtype bf16 --lengths 65536 --patterns s2,scca_flow,longmixed --warmup 1 --repeats 3
}

rest() {
    machine
    recorded_fit 80
    train_1b 130 16384,32768
    bench 60 dca-prefill dca --dtype bf16 --lengths 8192,16384,32768,65536,131072 --heads 32 --kv-heads 8 --head-dim 128 \
        --pretraining-length 4096 --longheads --warmup 1 --repeats 5
    # around the planner's longest fit on an 80 GB H100 (100,352 tokens on 79.2 GiB)
    WROTE+=("$RES/fit-8b-$GPU.json" "$RES/fit-8b-$GPU.md")
    step 180 fit-8b "$PY" scripts/fit_length.py --lengths 98304,106496 --output "$RES/fit-8b-$GPU.json" --overwrite
    # the gpu tests quick did not run; DeepSpeed's (a minute of FusedAdam JIT build) passed on the H200 (gpu-tests-h200.md)
    gpu_tests 100 tests/attn_patterns/test_cuda_kernels.py tests/train/test_cuda_training.py tests/evaluation/test_cuda_nf4.py \
        tests/attn_patterns/test_flex.py tests/bench/test_bench.py tests/modeling/test_loss.py tests/modeling/test_activations.py \
        tests/data/test_packed_sequences.py -k "not deepspeed"
}

exec > >(tee "$LOG") 2>&1
echo "scripts/gpu_bench.sh $PART on $GPU, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u); log: $LOG"
"$PART"

keep
[ -n "${OUT:-}" ] && tar tvf "$OUT/results.tar"
