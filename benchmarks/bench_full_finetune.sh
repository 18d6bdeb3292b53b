#!/usr/bin/env bash
# Issue 48's full fine-tuning against LoRA: the same warm-start recipe (walkthroughs, epochs,
# optimizer steps, schedule, seed) trained once into the LoRA of CONFIG (learner.lora_r) and once
# into every weight (--lora-r 0) at each learning rate of FULL_LRS, then every arm evaluated
# greedily on all 140 valid_seen + 134 valid_unseen games and each full arm compared with the
# LoRA arm, paired (`agentrl compare`: each side's success with its 95% interval, the difference,
# the exact McNemar p over the games one side won alone).
#
#   bash benchmarks/bench_full_finetune.sh [OUT] [CONFIG]
#
# OUT defaults to runs/full-finetune-<time>; CONFIG (the warm start's recipe) to
# configs/default.yaml, `make train`'s 120 walkthroughs, one epoch. FULL_LRS="5e-5 2e-4" (sft.lr of
# the full arms; the LoRA arm keeps CONFIG's); EVAL_CONFIG=configs/learning.yaml (T_max 30);
# SPACE=admissible (or free); SPLITS="valid_seen valid_unseen". Arms and evals already written are
# kept, so the same command continues an interrupted run. About 10 minutes a warm start and 21-27
# minutes an eval of one split on the 2-core CPU at 120 walkthroughs (docs/measurements/full-finetune.md).
set -euo pipefail
OUT=${1:-runs/full-finetune-$(date +%Y%m%d-%H%M%S)}
CONFIG=${2:-configs/default.yaml}
FULL_LRS=${FULL_LRS:-5e-5 2e-4}
EVAL_CONFIG=${EVAL_CONFIG:-configs/learning.yaml}
SPACE=${SPACE:-admissible}
SPLITS=${SPLITS:-valid_seen valid_unseen}
AGENTRL=${AGENTRL:-agentrl}
arms="lora"
for lr in $FULL_LRS; do arms="$arms full-$lr"; done
for arm in $arms; do
  if [ ! -f "$OUT/ws-$arm/agentrl.json" ]; then
    echo "== warm start $arm"
    flags=""; [ "$arm" != lora ] && flags="--lora-r 0 --lr ${arm#full-}"
    $AGENTRL sft --config "$CONFIG" $flags --out "$OUT/ws-$arm" 2>&1 | grep -v "━"
  fi
  for split in $SPLITS; do
    [ -f "$OUT/eval-$arm/$split/summary.json" ] && continue
    echo "== eval $arm $split"
    $AGENTRL eval --config "$EVAL_CONFIG" --adapter "$OUT/ws-$arm" --split "$split" --action-space "$SPACE" \
      --out "$OUT/eval-$arm/$split" 2>&1 | grep -v "━"
  done
done
for arm in $arms; do
  [ "$arm" = lora ] && continue
  echo "== LoRA against $arm, paired"
  $AGENTRL compare "$OUT/eval-lora" "$OUT/eval-$arm" --out "$OUT/compare-$arm"
done
