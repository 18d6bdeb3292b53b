#!/usr/bin/env bash
# Issue 48's action-space A/B: one adapter evaluated greedily on the same held-out games with free
# text (its Action: line fuzzy-mapped to an admissible command) and with admissible actions
# (constrained decoding), then compared paired (`agentrl compare`: each side's success with its 95%
# interval, the difference, the exact McNemar p over the games one side won alone).
#
#   bash benchmarks/bench_action_space.sh ADAPTER [OUT] [CONFIG]
#
# ADAPTER: a warm start (`agentrl sft`, prompt.reply action) or a trained adapter; OUT defaults to
# runs/action-space-<time>; CONFIG to configs/learning.yaml (T_max 30, max_new_tokens 32). Every
# eval writes OUT/<space>/<split>-<half>/ (episodes.jsonl, summary.json): each split runs as two
# lockstep batches of three task types, because 140 rows at T_max 30 hold an estimated 20 GB on a
# CPU in fp32, more than the KV plan (docs/measurements/action-space.md); the comparison pools them: OUT/compare/.
# SPLITS="valid_seen" limits the splits (default: both, all 140 + 134 games).
set -euo pipefail
ADAPTER=${1:?usage: bench_action_space.sh ADAPTER [OUT] [CONFIG]}
OUT=${2:-runs/action-space-$(date +%Y%m%d-%H%M%S)}
CONFIG=${3:-configs/learning.yaml}
SPLITS=${SPLITS:-valid_seen valid_unseen}
AGENTRL=${AGENTRL:-agentrl}
HALF_A="--task-type look_at_obj_in_light --task-type pick_and_place_simple --task-type pick_clean_then_place_in_recep"
HALF_B="--task-type pick_cool_then_place_in_recep --task-type pick_heat_then_place_in_recep --task-type pick_two_obj_and_place"
for space in free admissible; do
  for split in $SPLITS; do
    for half in a b; do
      [ -f "$OUT/$space/$split-$half/summary.json" ] && continue  # resume
      types=$HALF_A; [ $half = b ] && types=$HALF_B
      echo "== $space $split ($half)"
      $AGENTRL eval --config "$CONFIG" --adapter "$ADAPTER" --split "$split" --action-space "$space" $types \
        --out "$OUT/$space/$split-$half" 2>&1 | grep -v "━"
    done
  done
done
$AGENTRL compare "$OUT/free" "$OUT/admissible" --out "$OUT/compare"
