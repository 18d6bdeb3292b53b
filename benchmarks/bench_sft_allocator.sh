#!/usr/bin/env bash
# The allocator under `agentrl sft` (src/agentrl/procmem.py), side by side on the same optimizer
# steps: each arm continues the same checkpoint of a warm start for SECONDS, one arm at a time,
# and the table gives the steps each made in its first MINUTES minutes of training, seconds per
# step and speed against glibc with agentrl's fixed threshold (what sft ran on before 2026-12-07),
# with the process's page faults, system CPU and peak RSS (GNU time).
#
#   bash benchmarks/bench_sft_allocator.sh PARTIAL CONFIG [OUT] [SECONDS] [MINUTES]
#
# PARTIAL: an unfinished warm start's checkpoints (OUT.partial of a killed `agentrl sft --config
# CONFIG --out OUT`; its latest checkpoint is the arms' common start); CONFIG and the flags in
# SFT_FLAGS (e.g. "--epochs 2") must be the ones it was started with, or sft refuses to continue.
# OUT defaults to runs/sft-allocator, SECONDS to 250 (the process, loading included), MINUTES to 3.
# Arms: fixed (AGENTRL_MALLOC=fixed), mimalloc with its default purge delay (10 ms), mimalloc
# keeping its freed pages (the default for sft: MIMALLOC_PURGE_DELAY=-1). Run it alone on the machine.
set -euo pipefail
PARTIAL=${1:?usage: bench_sft_allocator.sh PARTIAL CONFIG [OUT] [SECONDS] [MINUTES]}
CONFIG=${2:?usage: bench_sft_allocator.sh PARTIAL CONFIG [OUT] [SECONDS] [MINUTES]}
OUT=${3:-runs/sft-allocator}
SECONDS_EACH=${4:-250}
MINUTES=${5:-3}
AGENTRL=${AGENTRL:-agentrl}
latest=$(cat "$PARTIAL/checkpoints/latest")
[ -x /usr/bin/time ] || { echo "error: GNU time (/usr/bin/time) is needed for the faults and peak RSS" >&2; exit 1; }
mkdir -p "$OUT"
printf '| arm | steps in %s min | s/step | speed vs fixed | page faults | system CPU s | peak RSS GiB |\n|---|---|---|---|---|---|---|\n' "$MINUTES" > "$OUT/table.md"
for arm in fixed mimalloc-purge10 mimalloc; do
  rm -rf "$OUT/$arm" "$OUT/$arm.partial"
  mkdir -p "$OUT/$arm.partial/checkpoints"
  cp -r "$PARTIAL/checkpoints/$latest" "$OUT/$arm.partial/checkpoints/"
  echo "$latest" > "$OUT/$arm.partial/checkpoints/latest"
  case $arm in
    fixed) vars=(AGENTRL_MALLOC=fixed) ;;
    mimalloc-purge10) vars=(AGENTRL_MALLOC=mimalloc MIMALLOC_PURGE_DELAY=10) ;;
    mimalloc) vars=(AGENTRL_MALLOC=mimalloc MIMALLOC_PURGE_DELAY=-1) ;;
  esac
  echo "$arm: ${SECONDS_EACH} s from $latest" >&2
  # shellcheck disable=SC2086
  env "${vars[@]}" /usr/bin/time -v -o "$OUT/$arm.time" timeout -s INT "$SECONDS_EACH" \
    "$AGENTRL" sft --config "$CONFIG" ${SFT_FLAGS:-} --out "$OUT/$arm" > "$OUT/$arm.log" 2>&1 || true
  python3 - "$OUT" "$arm" "$MINUTES" >> "$OUT/table.md" <<'PY'
import re, sys
out, arm, minutes = sys.argv[1], sys.argv[2], int(sys.argv[3])
log, time = open(f"{out}/{arm}.log").read(), open(f"{out}/{arm}.time").read()
start, epoch = map(int, re.search(r"at step (\d+) of \d+ \(epoch (\d+)\)", log).groups())
done, per_epoch = next(map(int, m.groups()) for m in re.finditer(rf"optimizer steps\s*(\d+)/(\d+).*?00:0{minutes}:\d+ elapsed", log))
steps = done - (start - (epoch - 1) * per_epoch)  # the progress counts the epoch's steps, the checkpoint all
got = {k: re.search(rf"{k}[^:]*: (\S+)", time).group(1) for k in ("Minor", "System time", "Maximum resident")}
base_file = f"{out}/base.steps"
if arm == "fixed":
    open(base_file, "w").write(str(steps))
base = int(open(base_file).read())
print(f"| {arm} | {steps} | {60 * minutes / steps:.1f} | {steps / base:.2f}x | {int(got['Minor']):,} | "
      f"{float(got['System time']):.0f} | {int(got['Maximum resident']) / 2**20:.2f} |")
PY
done
cat "$OUT/table.md"
