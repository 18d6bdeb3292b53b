#!/bin/bash
# Device call 3 (carry .dev/p3) after stash.sh and install.sh: what only a GPU can show of issue 47's
# sampler, in the order that decides the next step. BUDGET bounds the whole command (s).
#   1. the CUDA-only tests: a captured graph replay equals the same static step run eagerly; the
#      engine (graphs on by default on CUDA) equals a teacher-forced forward and the CPU's tokens;
#   2. benchmarks/bench_decode.py: the lockstep step of 128 rows x ~2k tokens x 30 new with graphs
#      and eager side by side, the floor beside them, GPU busy from the profiler;
#   3. benchmarks/bench_attention.py: SDPA's kernels on the decode and prefill shapes (--profile).
# Results: $OUT/tests.log, decode.json, attention.json (+ attention profile), graphs.log.
BUDGET=${BUDGET:-560}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) - 10 )); }
cd "$(dirname "$0")/../.."
test -d /tmp/st/cache/models || { echo "no prepared model on this machine: run stash.sh and install.sh first"; exit 3; }
mkdir -p /tmp/site /tmp/data && tar -C /tmp/site -xJf .dev/p3/fast_downward.tar.xz && tar -C /tmp/data -xJf .dev/p3/games.tar.xz
source benchmarks/lent_gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1
echo "== tests $(date +%T)"
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_static_decode.py tests/test_sampler.py \
  > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -n 3 $OUT/tests.log
echo "== decode $(date +%T), $(left)s left"
timeout -k 5 $(( $(left) / 2 )) python3 benchmarks/bench_decode.py --out $OUT/decode.json > $OUT/graphs.log 2>&1
echo "decode rc $?"; grep -E '"(s_per_step|ms_per_token|floor_ms_per_token|gpu_busy|speedup_graphs_over_eager|graphs_captured)"' $OUT/decode.json
echo "== attention $(date +%T), $(left)s left"
timeout -k 5 $(left) python3 benchmarks/bench_attention.py --profile $OUT/attn --out $OUT/attention.json >> $OUT/graphs.log 2>&1
echo "attention rc $?"; tail -n 30 $OUT/graphs.log
