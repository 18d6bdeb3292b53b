#!/bin/bash
# Build .dev/p4 for recipe.sh: every train game (the 4 MB archive of ../shared/data/alfworld-full.sh,
# its script, and the small data root's SHA256SUMS, which it checks the valid splits against) and
# their walkthroughs replayed here, exported from the replay cache (agentrl data replay). The first
# run replays all 3,553 games on every core (about 1.6-3 s of one core a game on the 2-core CPU
# machine: most of an hour); the cache keeps them, so a second run only exports.
#   bash benchmarks/lent_gpu/prepare_full.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DATA=${ALFWORLD_DATA:-../shared/data/alfworld}
SHARED=$(dirname "$DATA")
D=.dev/p4
rm -rf $D && mkdir -p $D
cp "$SHARED/alfworld-full.tar.xz" "$SHARED/alfworld-full.sh" "$DATA/SHA256SUMS" $D/
FULL=$(bash "$SHARED/alfworld-full.sh")
$PY -m agentrl.cli data replay --data "$FULL" --split train --export $D/replays-train.jsonl.xz
du -sh $D
