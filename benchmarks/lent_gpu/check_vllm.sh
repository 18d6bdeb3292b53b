#!/bin/bash
# The vLLM check on the lent GPU machine (carry .dev/p3), after install_vllm.sh and stash.sh +
# install.sh on the same warm machine: `agentrl doctor`'s vLLM line, the vllm section of `agentrl
# doctor --gpu` alone (the sampler's tokens/s at batch 1/8/64/256, then the carried adapter swapped
# in: swap_s, and whether the engine serves it: adapter_served), then ITERATIONS GRPO iterations
# with --sampler vllm at configs/gpu.yaml's scale from the carried adapter, with nvidia-smi's
# utilisation every 5 s. BUDGET bounds the whole command (s). Results: $OUT (doctor.txt,
# vllm_section.json, train.log, dmon.txt, results.tgz).
BUDGET=${BUDGET:-540}; ITERATIONS=${ITERATIONS:-2}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) - 15 )); }
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
test -d /tmp/site/vllm || { echo "no vLLM on this machine: run install_vllm.sh (carrying .dev/v1, .dev/v2) first"; exit 3; }
test -d /tmp/st/cache/models || { echo "no prepared model on this machine: run stash.sh and install.sh first"; exit 3; }
test -d .dev/p3/adapter || { echo "no adapter carried: prepare.sh ADAPTER_DIR"; exit 2; }
bash benchmarks/lent_gpu/unpack.sh
source benchmarks/lent_gpu/env.sh
echo "== doctor $(date +%T)"
agentrl doctor > $OUT/doctor.txt 2>&1; grep -i -E "vllm|torch|cuda" $OUT/doctor.txt
echo "== doctor --gpu's vllm section $(date +%T)"
timeout -k 10 $(( $(left) / 2 )) python3 - > $OUT/vllm_section.log 2>&1 <<'EOF'
import json, os
from agentrl.config import load_config
from agentrl.gpucheck import _sizes, _vllm
from agentrl.models import load_tokenizer

adapter = ".dev/p3/adapter"
r = json.load(open(os.path.join(adapter, "adapter_config.json")))["r"]
cfg = load_config("configs/gpu.yaml", {"model.device": "cuda", "learner.lora_r": r})  # the engine's rank fits the adapter
result = _vllm(cfg, load_tokenizer(cfg.model.name), _sizes(quick=False), {"adapter": adapter})
print("VLLM_SECTION", json.dumps(result))
json.dump(result, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "vllm_section.json"), "w"), indent=2)
EOF
echo "section rc $? after $(( $(date +%s) - T0 )) s"; grep -E "VLLM_SECTION|Error|error" $OUT/vllm_section.log | tail -n 5
echo "== train --sampler vllm, $ITERATIONS iterations $(date +%T), $(left)s left"
nvidia-smi dmon -s um -d 5 > $OUT/dmon.txt 2>&1 &
rm -rf /tmp/rv
timeout -k 10 $(left) python3 -c "from agentrl.cli import main; main()" train --config configs/gpu.yaml --sampler vllm \
  --init-adapter .dev/p3/adapter --kl-coef 50 --iterations $ITERATIONS --eval-every 0 --out /tmp/rv > $OUT/train.log 2>&1
echo "train rc $? after $(( $(date +%s) - T0 )) s"; grep -E "^it |Error|error" $OUT/train.log | tail -n 8
kill %1 2>/dev/null
python3 - <<'EOF'
import json
try:
    rows = [json.loads(l) for l in open("/tmp/rv/metrics.jsonl")]
except OSError:
    rows = []
for r in rows:
    if r.get("kind") == "iteration":
        print({k: r.get(k) for k in ("iteration", "rollout_s", "train_s", "swap_s", "iteration_s", "train_reward", "logprob_gap", "adapter_version", "rollout_adapter_versions")})
EOF
tar -C /tmp -czf $OUT/results.tgz --exclude=adapters --exclude=checkpoints --exclude='*.safetensors' rv 2>/dev/null
echo "done after $(( $(date +%s) - T0 )) s"
