#!/usr/bin/env bash
# Issue 49's signal measurement: ungated rollouts of train tasks disjoint from the warm start's,
# in chunks (each one `agentrl rollout`, its own groups.csv), then every chunk pooled by
# `agentrl analyze`: per K and signal the AUROC with its bootstrap interval against all-fail and
# all-success groups, the best cut at precision 0.8, the precision at half the all-fail groups,
# and the cross-fitted classifier on every signal together.
#
#   bash benchmarks/bench_gate_signals.sh ADAPTER [OUT] [CHUNKS] [CONFIG]
#
# ADAPTER: the policy measured (a warm start or a trained adapter); OUT defaults to
# runs/gate-signals; CHUNKS to 4 (24 tasks x G 8 each); CONFIG to configs/gate-auto.yaml (train
# games, T_max 30, temperature 0.7, signals at K 3, 5, 10, 15, 20; configs/gate-full.yaml is the same with
# admissible actions, for a policy from the warm start on every train game). SKIP (default 120: the warm
# start's games of configs/learning.yaml) is where the first chunk starts. A chunk with a
# groups.csv is kept, so the script resumes, and a later call with a larger CHUNKS adds groups to
# the pool (same adapter). ROUNDS (default 6: 32 rows in lockstep) bounds the memory a chunk holds.
# GATED=1 then runs the live gate on the last chunk's tasks: `--gate ${GATE}` (default the
# classifier on all nine signals at K 10) with `--gate-audit 0.25`, its labels warmed up from the
# other chunks' tables (never from the tasks it gates), paired with the last chunk's ungated
# rollout by `--tier1-baseline` (Tier 1 without paying the baseline twice): OUT/gated/tier1.md.
set -euo pipefail
ADAPTER=${1:?usage: bench_gate_signals.sh ADAPTER [OUT] [CHUNKS] [CONFIG]}
OUT=${2:-runs/gate-signals}
CHUNKS=${3:-4}
CONFIG=${4:-configs/gate-auto.yaml}
SKIP=${SKIP:-120}
AGENTRL=${AGENTRL:-agentrl}
tables=()
for i in $(seq 0 $((CHUNKS - 1))); do
  dir="$OUT/chunk$i"
  if [ ! -f "$dir/groups.csv" ]; then
    echo "== chunk $i: train tasks $((SKIP + 24 * i))..$((SKIP + 24 * i + 23))"
    $AGENTRL rollout --config "$CONFIG" --adapter "$ADAPTER" --gate off --gate-audit 0 \
      --skip-tasks $((SKIP + 24 * i)) --tasks 24 --rounds "${ROUNDS:-6}" --out "$dir" 2>&1 | grep -v "━"
  fi
  tables+=("$dir/groups.csv")
done
$AGENTRL analyze "${tables[@]}" --out "$OUT/analyze" --t-max 30
if [ "${GATED:-0}" = 1 ] && [ "$CHUNKS" -ge 2 ] && [ ! -f "$OUT/gated/tier1.json" ]; then
  last=$((CHUNKS - 1))
  { head -1 "$OUT/chunk0/groups.csv"; for i in $(seq 0 $((last - 1))); do tail -n +2 "$OUT/chunk$i/groups.csv"; done; } > "$OUT/warmup.csv"
  echo "== the live gate on chunk $last's tasks, warmed up from chunks 0..$((last - 1))"
  $AGENTRL rollout --config "$CONFIG" --adapter "$ADAPTER" --gate "${GATE:-10,auto:d+bigram+prefixes+actions+entropy+obs+tau+invalid+nll}" \
    --gate-audit 0.25 --gate-warmup "$OUT/warmup.csv" --skip-tasks $((SKIP + 24 * last)) --tasks 24 --rounds "${ROUNDS:-6}" \
    --tier1-baseline "$OUT/chunk$last" --out "$OUT/gated" 2>&1 | grep -v "━"
fi
