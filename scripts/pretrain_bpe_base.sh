#!/usr/bin/env bash
# The BPE base of issue 33 from a fresh start (docs/experiment.md says why each phase is there):
#
#   scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]                           # the recipe: six phases and a gate
#   SPARSE_FT_PHASES=4 scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]        # the four-phase recipe before it
#   SPARSE_FT_PHASES=2 scripts/pretrain_bpe_base.sh 3 OUTPUT                  # the two-phase base of 2026-11-27
#
# 1. Copy heads: a fresh model at a 256-token context on copy documents only (text, then a span
#    of words repeated to the document's end), at a CONSTANT lr of 1e-3. The loss sits on a
#    plateau for thousands of steps and then falls as copy (induction) heads form (seed 1: at step
#    ~2,850); a decaying lr, or text and retrieval documents in most blocks, kept every earlier
#    run on the plateau. These heads copy only the words they formed on.
# 2. Copying made generic (six phases only): 400 x 8 more at 256 tokens on spans of random ids of
#    the training text, no names (--copy-names 0). Heads formed on words generalise within a few
#    hundred steps; a fresh model on the same spans did not leave its plateau in 1,800 x 8. Without
#    it no base copied the evaluation's unseen words (cwe) or vt's variables.
# 3. Retrieval at C = 1,024 and its reach: RoPE's base raised from 10,000 to 500,000 (with 16
#    dimensions per head only two frequency pairs of eight stay coherent over 1,000 tokens at
#    10,000), blocks 60 % of which open with a retrieval document of every kind the evaluation
#    uses (passkey and RULER's 11 offline tasks) and 30 % with a copy document (in six phases half
#    of them of random ids, which keeps phase 2's copying), three quarters of these filling the
#    whole block, the text laid out three times, cosine lr from 1e-3, 1,000 x 4 (1,800 x 4 with
#    SPARSE_FT_PHASES=2, which stops here).
# 4. Key matching: drills alone (needles of RULER's form, then RULER's answer sentence for keys
#    at random, each with its value; scripts/probe_drills.py), 400 x 8 at 512 tokens, then (six
#    phases) on in 50-step spans until the first digit of the asked value is right in 95 % of
#    held-out drills, at most 1,200 steps. Matching forms at different times: seed 3 by step 200
#    (0.977 at 400, so it stops there), seed 1 not by 400 (0.486, which left its base short of the
#    bar) but by 750 (0.955).
# 5. (six phases) vt and cwe drills: variable-tracking chains and common-words lists of made-up
#    words, each asked and answered, 70 % of blocks, and 30 % copies of ids and names, 400 x 4.
# 6. (six phases) The mix at C = 1,024: lookup documents 55 % (needles, one key asked, then drills
#    of every key), vt and cwe drills and passkeys 35 %, copies 10 %, cosine lr from 1e-3, 800 x 4.
#    SPARSE_FT_PHASES=4 instead ends on lookup documents 90 % and every kind 10 %, 800 x 4.
# 7. (six phases) The gate: the held-out check decides (scripts/heldout_check.py: niah_multikey_1
#    on 120 prompts of training text at C with rare keys, which split into as many BPE pieces as
#    RULER's, from a seed space RULER's samples never use). A base reading >= 0.95 is the output as
#    phase 6 left it (seed 3's, the committed base, reads 0.958); one reading less goes on in
#    200-step spans, cosine from 5e-4, of lookup documents 75 %, vt and cwe drills and passkeys
#    20 %, copies 5 %, all on rare keys (--keys rare), fresh documents each (span k's --seed is
#    100 x SEED + k), each span checked, at most 6; the output is the first that passes, else the
#    last. Seed 2 (on 60 prompts): 0.917 after phase 6 (RULER's niah_multikey_1 0.79), 0.967 after
#    one span (0.88); with SPARSE_FT_KEYS=rare (on 120) 0.858, then 0.975 after four spans (0.89).
#
# Corpora, the phases' checkpoints and their held-out scores go under WORK (default: OUTPUT.work),
# built there once; every directory must be new or an earlier output of this script. Run the same
# command again after a kill or a stop: finished phases and checks are kept, the phase in progress
# resumes from its last checkpoint (PHASE.run, every 10 minutes and on SIGTERM or SIGINT).
# SPARSE_FT_THREADS sets torch's threads (default 2; two seeds at once: 1 each).
# SPARSE_FT_KEYS=rare (six phases) gives phases 3 to 6 and the drills the gate's rare keys, as long in
# BPE pieces as the evaluation's, in place of frequent ones (the default, which made the committed base).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: scripts/pretrain_bpe_base.sh SEED OUTPUT [WORK]" >&2
    exit 2
fi
seed=$1
output=$2
work=${3:-$output.work}
threads=${SPARSE_FT_THREADS:-2}
phases=${SPARSE_FT_PHASES:-6}
keys=${SPARSE_FT_KEYS:-frequent}
case $phases in
    2|4|6) ;;
    *) echo "SPARSE_FT_PHASES=$phases: must be 6 (the recipe), 4 (the recipe before it) or 2 (the base of 2026-11-27)" >&2
       exit 2 ;;
esac
case $keys in
    frequent) ;;
    rare) [ "$phases" = 6 ] || { echo "SPARSE_FT_KEYS=rare: only with SPARSE_FT_PHASES=6 (the recipes before it used frequent keys)" >&2; exit 2; } ;;
    *) echo "SPARSE_FT_KEYS=$keys: must be frequent (the recipe) or rare (the gate's keys from phase 3 on)" >&2
       exit 2 ;;
esac
mkdir -p "$work"
# a WORK holds one kind of keys: its phases and corpora would otherwise mix them
if [ -f "$work/keys" ] && [ "$(cat "$work/keys")" != "$keys" ]; then
    echo "SPARSE_FT_KEYS=$keys: WORK $work holds phases of $(cat "$work/keys") keys; name another WORK" >&2
    exit 2
fi
echo "$keys" > "$work/keys"
common=(--seed "$seed" --tokenizer bpe --threads "$threads" --eval-windows 50)
at_c=(--context 1024 --full-fraction 0.75 --scheduler cosine --lr 1e-3 --batch-size 4)

# phase OUTPUT STEPS FLAGS...: `sparse-ft pretrain` for STEPS steps into OUTPUT, unless OUTPUT holds
# this phase already (written whole at its end: a model of this seed, or of PHASE_SEED when set,
# trained for STEPS steps)
phase() {
    local out=$1 steps=$2 want=${PHASE_SEED:-$seed}
    shift 2
    if python -c 'import json, sys; s = json.load(open(sys.argv[1] + "/pretrain_stats.json"))
sys.exit(not (s["config"]["seed"] == int(sys.argv[2]) and s["steps"] == int(sys.argv[3])))' "$out" "$want" "$steps" 2>/dev/null; then
        echo "$out holds this phase (seed $want, $steps steps): kept" >&2
    else
        sparse-ft pretrain "${common[@]}" --output "$out" --steps "$steps" "$@" --seed "$want"
    fi
}

phase "$work/phase1" 3500 --context 256 --corpus "$work/corpus-copy" \
    --max-positions 1024 --retrieval-fraction 0 --copy-fraction 1.0 --max-blocks 12000 --scheduler constant --lr 1e-3 \
    --batch-size 8 --passkey-trials 0

if [ "$phases" = 6 ]; then
    phase "$work/phase2" 400 --context 256 --corpus "$work/corpus-ids" \
        --init-from "$work/phase1" --retrieval-fraction 0 --copy-fraction 1.0 --copy-pieces 1.0 --copy-names 0 \
        --max-blocks 3200 --scheduler constant --lr 1e-3 --warmup-steps 20 --batch-size 8 --passkey-trials 0
    reach=("$work/phase3" 1000 --corpus "$work/corpus-reach-ids" --init-from "$work/phase2" --max-blocks 4000
           --passkey-trials 0 --copy-pieces 0.5 --copy-names 0 --keys "$keys")
    drills=$work/phase4
    until=(--until 0.95 --max-steps 1200)
elif [ "$phases" = 4 ]; then
    reach=("$work/phase2" 1000 --corpus "$work/corpus-reach" --init-from "$work/phase1" --max-blocks 4000
           --passkey-trials 0)
    drills=$work/phase3
    until=()  # 400 steps, as this recipe ran
else
    reach=("$output" 1800 --corpus "$work/corpus-reach" --init-from "$work/phase1" --max-blocks 7200
           --passkey-trials 10)
fi
phase "${reach[@]}" "${at_c[@]}" --rope-theta 500000 --retrieval-tasks all \
    --retrieval-fraction 0.6 --copy-fraction 0.3 --text-passes 3 --warmup-steps 20
[ "$phases" = 2 ] && exit 0

if [ ! -f "$drills/probe.json" ]; then  # written last: the phase is done
    python "$(dirname "$0")/probe_drills.py" "${reach[0]}" "$drills" --steps 400 "${until[@]}" \
        --seed "$seed" --threads "$threads" --keys "$keys"
fi

if [ "$phases" = 4 ]; then
    phase "$output" 800 "${at_c[@]}" --corpus "$work/corpus-lookup" \
        --init-from "$drills" --retrieval-tasks all --retrieval-fraction 0.1 --lookup-fraction 0.9 \
        --max-blocks 3200 --passkey-trials 10
    exit 0
fi

phase "$work/phase5" 400 "${at_c[@]}" --corpus "$work/corpus-vt-cwe" \
    --init-from "$drills" --retrieval-tasks vt_drills,cwe_pseudo_drills --retrieval-fraction 0.7 --copy-fraction 0.3 \
    --copy-pieces 1.0 --max-blocks 1600 --warmup-steps 20 --passkey-trials 0 --keys "$keys"

mix=(--retrieval-tasks vt_drills,cwe_pseudo_drills,passkey --retrieval-fraction 0.35 --lookup-fraction 0.55
     --copy-fraction 0.1 --copy-pieces 1.0 --keys "$keys")
phase "$work/phase6" 800 "${at_c[@]}" --corpus "$work/corpus-mix" --init-from "$work/phase5" "${mix[@]}" \
    --max-blocks 3200 --passkey-trials 10

gate=0.95
# 60 prompts let seed 2's rare-key base through at 0.95 (RULER's niah_multikey_1 0.89); on 120 it read 0.925
gate_samples=120
spans=6
# the spans lean on lookup documents (needles in a haystack, one key asked, drills of every key): more of
# phase 6's own mix lifted seed 2's niah_multikey_1 from 0.79 only to 0.87-0.88 (docs/experiment.md)
span_data=(--retrieval-tasks vt_drills,cwe_pseudo_drills,passkey --retrieval-fraction 0.2 --lookup-fraction 0.75
           --copy-fraction 0.05 --copy-pieces 1.0 --keys rare)
# held CHECKPOINT: its held-out score, read once into CHECKPOINT.heldout.json
held() {
    if [ ! -f "$1.heldout.json" ]; then
        python "$(dirname "$0")/heldout_check.py" "$1" --keys rare --samples "$gate_samples" --threads "$threads" \
            > "$1.heldout.json.partial" || return 1
        mv "$1.heldout.json.partial" "$1.heldout.json"
    fi
    python -c 'import json, sys; d = json.load(open(sys.argv[1])); keys, n = d.get("keys"), d.get("samples")
if keys != "rare":
    sys.exit(f"{sys.argv[1]}: a score on {keys} keys, the gate reads rare ones; move it away")
if n != int(sys.argv[2]):
    sys.exit(f"{sys.argv[1]}: a score on {n} prompts, the gate reads {sys.argv[2]}; move it away")
print(d["scores"]["niah_multikey_1"])' "$1.heldout.json" "$gate_samples"
}
below() { python -c 'import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))' "$1" "$2"; }
last=$work/phase6
k=0
while :; do
    score=$(held "$last")  # a failed check stops the script here (set -e)
    echo "$last: held-out niah_multikey_1 $score (gate $gate)" >&2
    if ! below "$score" "$gate" || [ "$k" -ge "$spans" ]; then
        break
    fi
    k=$((k + 1))
    PHASE_SEED=$((100 * seed + k)) phase "$work/phase7-$k" 200 "${at_c[@]}" --corpus "$work/corpus-span$k" \
        --init-from "$last" "${span_data[@]}" --lr 5e-4 --warmup-steps 10 --max-blocks 800 --passkey-trials 0
    last=$work/phase7-$k
done

# the output: a copy of the checkpoint the gate chose, made whole or not at all
if [ -e "$output" ]; then
    if ! cmp -s "$output/pretrain_stats.json" "$last/pretrain_stats.json"; then
        echo "OUTPUT $output holds another model than the one the gate chose ($last): move it away and run again" >&2
        exit 1
    fi
    echo "$output holds $last: kept" >&2
else
    rm -rf "$output.partial"
    cp -r "$last" "$output.partial"
    mv "$output.partial" "$output"
    echo "$output: $last" >&2
fi
