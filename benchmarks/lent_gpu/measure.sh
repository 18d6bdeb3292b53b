#!/bin/bash
# Device call 3 of 3 (carry .dev/p3): GRPO at configs/gpu.yaml's scale (B 16 x G 8, T_max 30) from
# the carried adapter with KL to it (beta 50), then that adapter's greedy eval on every held-out
# game, with nvidia-smi's utilisation sampled every 5 s. BUDGET bounds the whole command (s);
# TRAIN_S the GRPO part. Results: $OUT (train.log, eval logs, results.tgz, dmon.txt).
BUDGET=${BUDGET:-560}; TRAIN_S=${TRAIN_S:-300}; ITERATIONS=${ITERATIONS:-3}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) - 20 )); }
cd "$(dirname "$0")/../.."
test -d /tmp/st/cache/models || { echo "no prepared model on this machine: run stash.sh and install.sh first"; exit 3; }
test -d .dev/p3/adapter || { echo "no adapter carried: prepare.sh ADAPTER_DIR"; exit 2; }
bash benchmarks/lent_gpu/unpack.sh
source benchmarks/lent_gpu/env.sh
rm -rf /tmp/r1 /tmp/ev && mkdir -p /tmp/ev
{ nvidia-smi; lscpu | grep -E "Model name|^CPU\(s\)"; } > $OUT/machine.txt 2>&1
nvidia-smi dmon -s um -d 5 > $OUT/dmon.txt 2>&1 &
echo "== train $(date +%T)"
timeout -k 10 $TRAIN_S python3 -c "from agentrl.cli import main; main()" train --config configs/gpu.yaml \
  --init-adapter .dev/p3/adapter --kl-coef 50 --iterations $ITERATIONS --eval-every 0 --out /tmp/r1 > $OUT/train.log 2>&1
echo "train rc $? after $(( $(date +%s) - T0 )) s"; grep -E "^it " $OUT/train.log
for split in valid_seen valid_unseen; do
  REM=$(left); [ $REM -gt 60 ] || break
  echo "== eval $split $(date +%T), ${REM}s left"
  timeout -k 10 $REM python3 -c "from agentrl.cli import main; main()" eval --config configs/gpu.yaml \
    --adapter .dev/p3/adapter --split $split --max-steps 30 --out /tmp/ev/$split > $OUT/eval-$split.log 2>&1
  echo "eval rc $?"; tail -n 3 $OUT/eval-$split.log
done
kill %1 2>/dev/null
tar -C /tmp -czf $OUT/results.tgz --exclude=adapters --exclude=checkpoints --exclude='*.safetensors' r1 ev 2>/dev/null
echo "done after $(( $(date +%s) - T0 )) s"
