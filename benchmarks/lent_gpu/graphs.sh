#!/bin/bash
# Device call 3 (carry .dev/p3) after stash.sh and install.sh: what only a GPU can show of issue 47's
# sampler. BUDGET bounds the whole command (s); PHASES (in their order, default all four) choose what
# runs; each phase has its own cap, and a phase that fails or times out leaves its log and the next
# one runs.
#   tests      the CUDA-only tests: a captured graph replay equals the same static step run eagerly
#              (also after the store grows); the engine equals a teacher-forced forward and the CPU;
#   decode     benchmarks/bench_decode.py: the lockstep step of 128 rows x ~2k tokens x 30 new with
#              graphs and eager side by side, the floor beside them, GPU busy from the profiler, once
#              per kernel in DECODE_KERNELS (default: SDPA's own choice, then cuDNN pinned), each in
#              its own process;
#   e2e        where an adapter was carried (prepare.sh ADAPTER_DIR): GRPO iterations at
#              configs/gpu.yaml's scale (B 16 x G 8, T_max 30) from it with KL to it (beta 50), and
#              its greedy eval on every held-out game, with E2E_KERNEL pinned (default: the kernel
#              whose captured step was fastest in `decode`; eager decoding where none captured);
#              PROFILE=1 runs the evals under cProfile and appends their top functions to eval-*.log;
#   ab         after e2e: its eval of AB_SPLIT (default valid_seen) again once per arm of AB_ARMS,
#              each `section.key=value` setting one YAML value (default: sampling.prefill_buckets
#              "off", e2e's on being CUDA's default; env.overlap true, the env stepping one wave of
#              groups while the captured step decodes the other), then every arm beside e2e's:
#              generate and env seconds, prefill forwards, shapes and pads, games won (paired);
#   attention  benchmarks/bench_attention.py: SDPA's kernels on the decode and prefill shapes and on
#              the model's step (--profile).
# Results in $OUT: tests.log, decode-<kernel>.json/.log, train.log, eval-*.log, ab.log, results.tgz,
# attention.json/.log and attn/ (profiles). A CPU dry run of the script: DRY=1 (small shapes).
BUDGET=${BUDGET:-560}; PHASES=${PHASES:-tests decode e2e attention}; DECODE_KERNELS=${DECODE_KERNELS:-auto cudnn}
TESTS_S=${TESTS_S:-80}; DECODE_S=${DECODE_S:-100}; TRAIN_S=${TRAIN_S:-130}; ITERATIONS=${ITERATIONS:-2}
EVAL_SPLITS=${EVAL_SPLITS:-valid_seen valid_unseen}; ATTENTION_S=${ATTENTION_S:-100}  # time kept for `attention`
AB_SPLIT=${AB_SPLIT:-valid_seen}; AB_ARMS=${AB_ARMS:-sampling.prefill_buckets=\"off\" env.overlap=true}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) - 10 )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # a phase's cap, never past the budget
cd "$(dirname "$0")/../.."
if [ -z "$DRY" ]; then
  test -d /tmp/st/cache/models || { echo "no prepared model on this machine: run stash.sh and install.sh first"; exit 3; }
  bash benchmarks/lent_gpu/unpack.sh
  source benchmarks/lent_gpu/env.sh
  DECODE_ARGS=""; ATTENTION_ARGS=""
else  # the CPU here, the venv's python, the prepared model and games where they are
  OUT=${OUT:-/tmp/graphs-dry}; mkdir -p $OUT; export PYTHONUNBUFFERED=1
  DECODE_ARGS="--quick"; ATTENTION_ARGS="--calls 2 --lengths 128 --model-rows 2 --context 128 --steps 1"
fi
AG=(python3 -c "from agentrl.cli import main; main()")   # an array: `timeout` runs it (a shell function it cannot)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1

tests() {
  echo "== tests $(date +%T)"
  timeout -k 5 $(cap $TESTS_S) python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_static_decode.py tests/test_sampler.py \
    > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -n 3 $OUT/tests.log
}

decode() {
  for kernel in $DECODE_KERNELS; do
    echo "== decode ($kernel) $(date +%T), $(left)s left"
    timeout -k 5 $(cap $DECODE_S) python3 benchmarks/bench_decode.py $DECODE_ARGS --attention-backend $kernel \
      --out $OUT/decode-$kernel.json > $OUT/decode-$kernel.log 2>&1
    echo "decode rc $?"
    grep -E '"(s_per_step|first_step_s|ms_per_token|floor_ms_per_token|gpu_busy|speedup_graphs_over_eager|graphs_captured)"' \
      $OUT/decode-$kernel.json || tail -n 20 $OUT/decode-$kernel.log
  done
}

e2e() {
  [ -d .dev/p3/adapter ] && [ -z "$DRY" ] || { echo "== e2e skipped: no adapter carried (or a dry run)"; return; }
  local kernel=$E2E_KERNEL static=on
  if [ -z "$kernel" ]; then  # the kernel whose captured step was fastest; eager decoding where none captured
    read kernel static <<< "$(python3 - $OUT <<'PY'
import json, pathlib, sys
runs = {}
for p in pathlib.Path(sys.argv[1]).glob("decode-*.json"):
    graphs = json.loads(p.read_text())["lockstep"]["by_decode"].get("graphs")
    if graphs:
        runs[p.stem.removeprefix("decode-")] = graphs["s_per_step"]
print(f"{min(runs, key=runs.get)} on" if runs else "auto off")
PY
)"
  fi
  sed "/^sampling:/a\\  attention_backend: $kernel\n  static_decode: \"$static\"" configs/gpu.yaml > /tmp/e2e.yaml
  echo "== e2e with sampling.attention_backend $kernel, static_decode $static"
  rm -rf /tmp/r1 /tmp/ev && mkdir -p /tmp/ev
  for split in $EVAL_SPLITS; do
    local rem=$(( $(left) - TRAIN_S - ATTENTION_S / 2 )); [ $rem -gt 40 ] || break
    echo "== eval $split $(date +%T), ${rem}s for it"
    local t=$(date +%s)
    local run=("${AG[@]}")  # PROFILE=1: under cProfile (host time by function; slower), its top functions kept
    [ -n "$PROFILE" ] && run=(python3 -m cProfile -o /tmp/ev/$split.prof -m agentrl.cli)
    timeout -k 10 $rem "${run[@]}" eval --config /tmp/e2e.yaml --adapter .dev/p3/adapter --split $split --max-steps 30 \
      --out /tmp/ev/$split > $OUT/eval-$split.log 2>&1
    echo "eval rc $? in $(( $(date +%s) - t )) s"; tail -n 3 $OUT/eval-$split.log
    [ -f /tmp/ev/$split.prof ] && python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(40); s.sort_stats('tottime').print_stats(25)" \
      /tmp/ev/$split.prof >> $OUT/eval-$split.log 2>&1
  done
  E2E_RAN=1  # the ab phase compares against these evals
  echo "== train $(date +%T), $(left)s left"
  t=$(date +%s)
  timeout -k 10 $(cap $TRAIN_S) "${AG[@]}" train --config /tmp/e2e.yaml --init-adapter .dev/p3/adapter --kl-coef 50 \
    --iterations $ITERATIONS --eval-every 0 --out /tmp/r1 > $OUT/train.log 2>&1
  echo "train rc $? in $(( $(date +%s) - t )) s"; grep -E "^it " $OUT/train.log || tail -n 5 $OUT/train.log
  tar -C /tmp -czf $OUT/results.tgz --exclude=adapters --exclude=checkpoints --exclude='*.safetensors' r1 ev 2>/dev/null
}

ab() {  # e2e's eval of AB_SPLIT again once per arm of AB_ARMS, each one setting changed, side by side
  [ -n "$E2E_RAN" ] && [ -f /tmp/ev/$AB_SPLIT/summary.json ] || { echo "== ab skipped: e2e's eval of $AB_SPLIT did not run in this call"; return; }
  local dirs=(/tmp/ev/$AB_SPLIT) arm
  for arm in $AB_ARMS; do  # section.key=value, the value as YAML (quote on/off: YAML reads them as booleans)
    local sec=${arm%%.*} rest=${arm#*.}; local key=${rest%%=*} val=${rest#*=}
    local name=$(printf '%s' "$key-$val" | tr -c 'a-zA-Z0-9-' '_')
    sed "/^$sec:/a\\  $key: $val" /tmp/e2e.yaml > /tmp/ab-$name.yaml
    local rem=$(( $(left) - 10 )); [ $rem -gt 40 ] || { echo "== ab: no time left for $arm"; break; }
    echo "== ab: $AB_SPLIT with $sec.$key: $val $(date +%T), ${rem}s for it"
    local t=$(date +%s)
    timeout -k 10 $rem "${AG[@]}" eval --config /tmp/ab-$name.yaml --adapter .dev/p3/adapter --split $AB_SPLIT \
      --max-steps 30 --out /tmp/ev/$AB_SPLIT-$name > $OUT/eval-$AB_SPLIT-$name.log 2>&1
    echo "eval rc $? in $(( $(date +%s) - t )) s"
    [ -f /tmp/ev/$AB_SPLIT-$name/summary.json ] && dirs+=(/tmp/ev/$AB_SPLIT-$name)
  done
  { python3 - "${dirs[@]}" <<'PY'
import json, pathlib, sys
base = None
for d in sys.argv[1:]:
    s = json.loads((pathlib.Path(d) / "summary.json").read_text())
    t, m, o = s["timing"], s["memory"] or {}, s["overall"]
    base = base or t["generate_s"]
    print(f"{pathlib.Path(d).name:40s} generate {t['generate_s']:6.1f} s ({t['generate_s'] / base:.2f}x e2e's)  env {t['env_s']:5.1f} s"
          f"  per step {t['s_per_step']:.2f} s  prefill forwards {m.get('kv_prefill_forwards')} (shapes {m.get('kv_prefill_shapes')},"
          f" tokens {m.get('kv_prefill_tokens')} + pads {m.get('kv_prefill_pad_tokens')})  won {o['won']}/{o['games']}")
PY
    for d in "${dirs[@]:1}"; do "${AG[@]}" compare ${dirs[0]} $d | tail -n 2; done; } 2>&1 | tee $OUT/ab.log
  tar -C /tmp -czf $OUT/results.tgz --exclude=adapters --exclude=checkpoints --exclude='*.safetensors' r1 ev 2>/dev/null
}

attention() {
  echo "== attention $(date +%T), $(left)s left"
  timeout -k 5 $(left) python3 benchmarks/bench_attention.py $ATTENTION_ARGS --profile $OUT/attn --out $OUT/attention.json \
    > $OUT/attention.log 2>&1
  echo "attention rc $?"; tail -n 30 $OUT/attention.log
}

for phase in $PHASES; do
  case $phase in tests|decode|e2e|ab|attention) $phase ;; *) echo "unknown phase $phase" ;; esac
done
echo "done after $(( $(date +%s) - T0 )) s"
