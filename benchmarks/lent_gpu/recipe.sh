#!/bin/bash
# Device call 3 (carry .dev/p3 and .dev/p4), after stash.sh and install.sh: the whole recipe in one
# call of at most 10 minutes (issue 47, item 7): the warm start on every train walkthrough of the
# full data set (replays imported from the carried cache: nothing is replayed there), the greedy
# eval of all 274 held-out games, as many GRPO iterations at configs/gpu.yaml's scale (B 16 x G 8,
# T_max 30) as the time left allows, and the 274-game eval again. Set-up, imports and CUDA-graph
# captures count: nothing survives between sessions.
#   BUDGET    seconds for the whole command (default 570: a 600 s call with room to pack results)
#   GAMES     walkthroughs for the warm start (default: all of the split); EPOCHS (default 2)
#   ADAPTER   start from this adapter instead of a warm start (e.g. .dev/p3/adapter): sft is skipped
# $OUT: recipe.log (every phase's seconds and result lines), recipe.json (the same, machine-read),
# results.tgz (eval summaries + per-game episodes, sft and train metrics), adapter.tgz.part-* (the
# final adapter in bf16, split under the 16 MiB a returned file may have).
# A CPU rehearsal of the whole script here: DRY=1 (the venv's python, the shared data, GAMES
# walkthroughs (default 8) replayed and exported here for the import phase, and tiny sizes: evals
# of 4 games x 4 steps, GRPO at B 2 x G 2 x T_max 4, gate K 2, an invalid reply's reward -0.1 (the
# only reward variance an 8-game warm start has there, so the learner and the swap run at times),
# until the budget's timeout stops it as it does on the GPU; $OUT defaults to /tmp/recipe-dry).
# It checks the script, not the speed: 6.3 min at BUDGET=420 here (2026-12-03).
BUDGET=${BUDGET:-570}; EPOCHS=${EPOCHS:-2}
T0=$(date +%s); now() { echo $(( $(date +%s) - T0 )); }; left() { echo $(( BUDGET - $(now) )); }
cd "$(dirname "$0")/../.."
RC=/tmp/rc; EVAL_ARGS=(); TRAIN_ARGS=()
if [ -z "$DRY" ]; then
  test -d /tmp/st/cache/models || { echo "no prepared model on this machine: run stash.sh and install.sh first"; exit 3; }
  test -f .dev/p4/alfworld-full.tar.xz || { echo "no full data set carried: prepare_full.sh, then carry .dev/p4"; exit 2; }
  mkdir -p $RC && bash benchmarks/lent_gpu/unpack.sh
  cp .dev/p4/alfworld-full.tar.xz .dev/p4/alfworld-full.sh /tmp/data/ && cp .dev/p4/SHA256SUMS /tmp/data/alfworld/  # valid_* come from there
  DATA=$(bash /tmp/data/alfworld-full.sh /tmp/data/alfworld-full 2>>$OUT/recipe.log) || { echo "unpacking the games failed"; exit 1; }
  source benchmarks/lent_gpu/env.sh
  REPLAYS=.dev/p4/replays-train.jsonl.xz
else  # the CPU here: every phase at tiny sizes, the same commands and timeouts
  OUT=${OUT:-/tmp/recipe-dry}; RC=$OUT/rc; GAMES=${GAMES:-8}; EPOCHS=1
  rm -rf $RC && mkdir -p $RC; : > $OUT/recipe.log; : > $OUT/recipe.json
  export PATH=$PWD/.venv/bin:$PATH PYTHONUNBUFFERED=1 COLUMNS=160
  DATA=$(bash ../shared/data/alfworld-full.sh 2>>$OUT/recipe.log) || { echo "unpacking the games failed"; exit 1; }
  REPLAYS=$RC/replays-train.jsonl.xz   # what prepare_full.sh exports, for GAMES games only
  python3 -m agentrl.cli data replay --data $DATA --split train --games $GAMES --export $REPLAYS >> $OUT/recipe.log 2>&1 \
    || { echo "replaying $GAMES walkthroughs failed"; exit 1; }
  EVAL_ARGS=(--limit 4 --max-steps 4); TRAIN_ARGS=(--tasks 2 --group-size 2 --max-steps 4 --gate 2,auto --invalid-action-reward -0.1)
fi
export ALFWORLD_DATA=$DATA
AG=(python3 -c "from agentrl.cli import main; main()")   # an array: `timeout` runs it (a shell function it cannot)
phase() { echo "{\"phase\": \"$1\", \"rc\": $2, \"s\": $3, \"at_s\": $(now)}" >> $OUT/recipe.json; echo "== $1: rc $2 in $3 s ($(now) s elapsed)"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; } > $OUT/machine.txt 2>&1
phase setup 0 $(now)

t=$(now); "${AG[@]}" data replay --split train ${GAMES:+--games $GAMES} --import $REPLAYS >> $OUT/recipe.log 2>&1
phase replay_import $? $(( $(now) - t ))

WS=${ADAPTER:-$RC/warmstart}
if [ -z "$ADAPTER" ]; then
  t=$(now)
  timeout -k 10 $(( $(left) - 200 )) "${AG[@]}" sft --config configs/gpu.yaml ${GAMES:+--games $GAMES} --epochs $EPOCHS \
    --out $WS >> $OUT/recipe.log 2>&1
  phase sft $? $(( $(now) - t )); tail -n 4 $OUT/recipe.log
fi
test -f $WS/adapter_config.json || { echo "no warm start to go on from"; exit 1; }

evals() {  # $1: a name, $2: the adapter; both held-out splits, each in the time left
  for split in valid_seen valid_unseen; do
    t=$(now)
    timeout -k 10 $(( $(left) - 15 )) "${AG[@]}" eval --config configs/gpu.yaml --adapter $2 --split $split --max-steps 30 \
      "${EVAL_ARGS[@]}" --out $RC/eval-$1/$split >> $OUT/recipe.log 2>&1
    phase eval-$1-$split $? $(( $(now) - t )); tail -n 2 $OUT/recipe.log
  done
}
t_eval=$(now); evals before $WS; t_eval=$(( $(now) - t_eval ))

t=$(now); TRAIN_S=$(( $(left) - t_eval - 30 ))   # the second eval takes what the first took
if [ $TRAIN_S -gt 60 ]; then
  timeout -k 10 $TRAIN_S "${AG[@]}" train --config configs/gpu.yaml --init-adapter $WS --iterations 1000 --eval-every 0 \
    "${TRAIN_ARGS[@]}" --out $RC/run >> $OUT/recipe.log 2>&1
  phase train $? $(( $(now) - t )); grep -E "^it " $OUT/recipe.log | tail -n 3
fi
LAST=$RC/run/checkpoints/$(cat $RC/run/checkpoints/latest 2>/dev/null)/adapter
if [ -f $LAST/adapter_config.json ]; then
  evals after $LAST
  python3 - "$LAST" $RC/final <<'EOF'
import sys, shutil, pathlib, torch
from safetensors.torch import load_file, save_file
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
save_file({k: v.to(torch.bfloat16) for k, v in load_file(src / "adapter_model.safetensors").items()}, dst / "adapter_model.safetensors")
EOF
  tar -C $RC -czf - final | split -b 15M - $OUT/adapter.tgz.part-
fi
# no weights in results.tgz (the warm start's alone is 39 MB in fp32): a returned file must stay under
# 16 MiB, and the final adapter comes back as adapter.tgz.part-*
tar -C $RC -czf $OUT/results.tgz --exclude=adapters --exclude=checkpoints --exclude=final --exclude='*.safetensors' . 2>/dev/null
ls -l $OUT/results.tgz $OUT/adapter.tgz.part-* 2>/dev/null | awk '{print $5, $NF}' >> $OUT/recipe.log
phase done 0 $(now)
