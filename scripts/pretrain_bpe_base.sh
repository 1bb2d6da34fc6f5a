#!/usr/bin/env bash
# The BPE base of issue 33 in two phases of `sparse-ft pretrain` (docs/experiment.md says why):
#
#   scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]
#
# 1. Copy heads: a fresh model at a 256-token context on copy documents only (text, then a span
#    of words repeated to the document's end), at a CONSTANT lr of 1e-3. The loss sits on a
#    plateau for thousands of steps and then falls as copy (induction) heads form (seed 1: at step
#    ~2,850); a decaying lr, or text and retrieval documents in most blocks, kept every earlier
#    run on the plateau. The copy probe printed at the end says whether they formed.
# 2. Retrieval at C = 1,024 and its reach: from phase 1's weights, RoPE's base raised from 10,000
#    to 500,000 (with 16 dimensions per head only two frequency pairs of eight stay coherent over
#    1,000 tokens at 10,000: bases kept there found a needle reliably only ~500 tokens back), blocks
#    60 % of which open with a retrieval document of every kind the evaluation uses (passkey and
#    RULER's 11 offline tasks) and 30 % with a copy document, three quarters of these filling the
#    whole block (needles ~1,000 tokens before their question, which uniform lengths rarely draw),
#    the text laid out three times so that no block is read twice, cosine lr from 1e-3, 1,800 x 4.
#    It replaced two phases (retrieval at 10,000, then reach at 500,000) in half their steps, with
#    the same passkey and single-needle scores on seeds 1-3 (docs/experiment.md).
#
# Corpora and phase 1's checkpoint go under WORK (default: OUTPUT.work), built there once; every
# directory must be new or an earlier output of this script. SPARSE_FT_THREADS sets torch's
# threads (default 2; two seeds at once: 1 each).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]" >&2
    exit 2
fi
seed=$1
output=$2
work=${3:-$output.work}
threads=${SPARSE_FT_THREADS:-2}
mkdir -p "$work"
common=(--seed "$seed" --tokenizer bpe --threads "$threads" --eval-windows 50)

sparse-ft pretrain "${common[@]}" --context 256 --corpus "$work/corpus-copy" --output "$work/phase1" \
    --max-positions 1024 --retrieval-fraction 0 --copy-fraction 1.0 --max-blocks 12000 --scheduler constant --lr 1e-3 \
    --steps 3500 --batch-size 8 --passkey-trials 0

sparse-ft pretrain "${common[@]}" --context 1024 --corpus "$work/corpus-reach" --output "$output" \
    --init-from "$work/phase1" --rope-theta 500000 --retrieval-tasks all --retrieval-fraction 0.6 --copy-fraction 0.3 \
    --full-fraction 0.75 --text-passes 3 --max-blocks 7200 --scheduler cosine --lr 1e-3 --warmup-steps 20 --steps 1800 \
    --batch-size 4 --passkey-trials 10
