#!/usr/bin/env bash
# The BPE base of issue 33 in four phases (docs/experiment.md says why each is there):
#
#   scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]
#   SPARSE_FT_PHASES=2 scripts/pretrain_bpe_base.sh 3 OUTPUT    # the committed assets/tiny-base-bpe
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
#    the text laid out three times so that no block is read twice, cosine lr from 1e-3, 1,000 x 4
#    (1,800 x 4 with SPARSE_FT_PHASES=2, the former recipe, which stops here: the committed base).
#    It replaced two phases (retrieval at 10,000, then reach at 500,000) in half their steps, with
#    the same passkey and single-needle scores on seeds 1-3 (docs/experiment.md).
# 3. Key matching: drills alone (needles of RULER's form, then RULER's answer sentence for keys
#    at random, each with its value; scripts/probe_drills.py), 400 x 8 at 512 tokens. Bases made
#    by phases 1-2 alone answered niah_multikey_1 with a needle at random; the first digit of the
#    asked value forms here by step ~350.
# 4. Lookup documents at C = 1,024 (90 % of blocks; 10 % retrieval documents of every kind):
#    needles in a haystack, one key asked, then drills of every key; cosine lr from 1e-3, 800 x 4.
#    Phases 3-4 on the phase-2 base of the former recipe gave niah_multikey_1 1.00 and 0.95 on
#    two seeds (docs/experiment.md, "A drills phase, then lookup documents"); all four phases from
#    a fresh start gave 0.95 (seed 2) and 0.85 (seed 1) in 67-69 min on a 2-core AMD EPYC.
#
# Corpora and phases 1-3's checkpoints go under WORK (default: OUTPUT.work), built there once; every
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
phases=${SPARSE_FT_PHASES:-4}
case $phases in
    2) reach_steps=1800 reach_output=$output reach_passkeys=10 ;;
    4) reach_steps=1000 reach_output=$work/phase2 reach_passkeys=0 ;;
    *) echo "SPARSE_FT_PHASES=$phases: must be 4 (the recipe) or 2 (the committed base's)" >&2; exit 2 ;;
esac
mkdir -p "$work"
common=(--seed "$seed" --tokenizer bpe --threads "$threads" --eval-windows 50)

sparse-ft pretrain "${common[@]}" --context 256 --corpus "$work/corpus-copy" --output "$work/phase1" \
    --max-positions 1024 --retrieval-fraction 0 --copy-fraction 1.0 --max-blocks 12000 --scheduler constant --lr 1e-3 \
    --steps 3500 --batch-size 8 --passkey-trials 0

sparse-ft pretrain "${common[@]}" --context 1024 --corpus "$work/corpus-reach" --output "$reach_output" \
    --init-from "$work/phase1" --rope-theta 500000 --retrieval-tasks all --retrieval-fraction 0.6 --copy-fraction 0.3 \
    --full-fraction 0.75 --text-passes 3 --max-blocks $((4 * reach_steps)) --scheduler cosine --lr 1e-3 --warmup-steps 20 \
    --steps "$reach_steps" --batch-size 4 --passkey-trials "$reach_passkeys"
[ "$phases" = 2 ] && exit 0

if [ ! -f "$work/phase3/probe.json" ]; then  # written last: the phase is done
    python "$(dirname "$0")/probe_drills.py" "$work/phase2" "$work/phase3" --steps 400 --seed "$seed" --threads "$threads"
fi

sparse-ft pretrain "${common[@]}" --context 1024 --corpus "$work/corpus-lookup" --output "$output" \
    --init-from "$work/phase3" --retrieval-tasks all --retrieval-fraction 0.1 --lookup-fraction 0.9 --full-fraction 0.75 \
    --max-blocks 3200 --scheduler cosine --lr 1e-3 --steps 800 --batch-size 4 --passkey-trials 10
