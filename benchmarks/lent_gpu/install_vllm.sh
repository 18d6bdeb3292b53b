#!/bin/bash
# Device calls for vLLM (prepare_vllm.sh built .dev/v1, .dev/v2, ...): the same command in each call,
# carrying the next folder, back to back (a machine goes back 30 s after a call). Each call keeps its
# part in /tmp/st/vllm; the call that brings the last one joins them, checks the sha256, unpacks vLLM
# into /tmp/site, installs the carried wheels there (--no-deps), lists any requirement of the carried
# set that the machine does not meet, and imports vllm.
#   bash benchmarks/lent_gpu/install_vllm.sh        (carry .dev/v1; then again carrying .dev/v2; ...)
set -e
cd "$(dirname "$0")/../.."
S=/tmp/st/vllm
mkdir -p $S /tmp/site
for d in .dev/v[0-9]*; do
  [ -d "$d" ] || continue
  cp "$d"/part.* "$d"/vllm.sha256 "$d"/parts.txt $S/ 2>/dev/null || true
  if [ -d "$d/whl" ]; then mkdir -p $S/whl && cp "$d"/whl/*.whl $S/whl/; fi
done
test -f $S/parts.txt || { echo "no vLLM part carried: carry .dev/v1 (bash benchmarks/lent_gpu/prepare_vllm.sh builds it)"; exit 2; }
missing=$(cd $S && for p in $(cat parts.txt); do [ -f "$p" ] || echo "$p"; done)
if [ -n "$missing" ] || [ ! -d $S/whl ]; then
  echo "kept $(cd $S && ls part.* | tr '\n' ' ')in $S; still to carry: ${missing:-the wheels} (the next .dev/vN, within 30 s)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  exit 0
fi
T0=$(date +%s)
(cd $S && cat $(cat parts.txt)) > $S/vllm.tar.xz
echo "$(cat $S/vllm.sha256)  $S/vllm.tar.xz" | sha256sum -c
tar -C /tmp/site -xJf $S/vllm.tar.xz && rm -f $S/vllm.tar.xz $S/part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl
echo "installed in $(( $(date +%s) - T0 )) s"
source benchmarks/lent_gpu/env.sh
# what the carried set asks for and the machine's image does not give (a list, not a stop: only
# what vLLM imports matters, and the import below is the test of that)
python3 - <<'EOF'
import importlib.metadata as md, os, re
from packaging.requirements import Requirement
carried = ["vllm"] + sorted({re.sub(r"-[0-9].*", "", f) for f in os.listdir("/tmp/st/vllm/whl")})
absent, other = set(), []
for name in carried:
    for line in md.requires(name) or []:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            absent.add(r.name)
            continue
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            other.append(f"{name} asks {r}, here {have}")
print(f"asked for by the carried set, absent here ({len(absent)}):", ", ".join(sorted(absent)))
print(f"asked for at another version ({len(other)}):", "; ".join(other))
EOF
python3 -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -c "import vllm.entrypoints.llm, vllm.v1.worker.gpu_model_runner, vllm.model_executor.models.llama, vllm.lora.worker_manager, vllm.v1.attention.backends.flash_attn as fa, vllm.vllm_flash_attn.flash_attn_interface as fi; print('FA3', fi.FA3_AVAILABLE, fi.FA3_UNAVAILABLE_REASON or '')"
