# Source on the lent GPU machine after install.sh (and measure.sh's unpacking): agentrl from src/
# with the carried wheels, the jericho stub, the prepared model and the games.
export PYTHONPATH=/tmp/site:$PWD/benchmarks/lent_gpu/stub:$PWD/src AGENTRL_CACHE=/tmp/st/cache
export ALFWORLD_DATA=/tmp/data/alfworld PYTHONUNBUFFERED=1 COLUMNS=160
agentrl() { python3 -c "from agentrl.cli import main; main()" "$@"; }
# vLLM, where install_vllm.sh put it in /tmp/site: stubs last on the path for the structured-output
# imports it makes at load (stub_vllm/), its sampler without FlashInfer (not carried), no usage stats
# and no hub look-ups (no network there: fail at once rather than wait)
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/lent_gpu/stub_vllm VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
