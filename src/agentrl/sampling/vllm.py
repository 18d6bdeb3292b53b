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
- the base model stays resident; each adapter version becomes a new `LoRARequest` (new name,
  new integer id, its own directory), so no stale weights are served from vLLM's LoRA cache,
  and the previous one is removed from the engine.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from agentrl.errors import UserError
from agentrl.sampling.base import Completion, SamplingParams
from agentrl.sampling.hf import stop_token_ids

log = logging.getLogger(__name__)

# vLLM accepts only these values for max_lora_rank (LoRAConfig); an adapter of rank r <= max_lora_rank loads.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank-r adapters."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise UserError(f"learner.lora_r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {lines[0]}" if lines else e.__class__.__name__


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
    ):
        """`llm`: a built `vllm.LLM` (or a stand-in with the same `generate`). `max_lora_rank` and
        `target_modules` are what the engine was started for: adapters beyond them are refused."""
        self.llm = llm
        self.tokenizer = tokenizer
        self.max_lora_rank = max_lora_rank
        self.target_modules = list(target_modules) if target_modules is not None else None
        self.stop_ids = set(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
        self.max_model_len = max_model_len
        self.adapter_version: int | None = None
        self.swap_s: float | None = None  # seconds the last load_adapter took
        self._lora = None  # the LoRARequest every generate call uses (None: the base model)
        self._next_lora_id = 1  # vLLM LoRA ids must be > 0; every load gets a fresh one
        if adapter:
            self.load_adapter(adapter, version=0)

    @classmethod
    def from_config(cls, cfg) -> "VLLMSampler":
        import dataclasses
        import types

        import vllm

        from agentrl.models import load_tokenizer, resolve_model

        path = resolve_model(cfg.model.name)
        tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
        rank = engine_lora_rank(cfg.learner.lora_r)
        kwargs = dict(
            model=path,
            tokenizer=path,
            enable_lora=True,
            max_lora_rank=rank,
            max_loras=cfg.sampling.max_loras,
            enable_prefix_caching=True,
            gpu_memory_utilization=cfg.sampling.gpu_memory_utilization,
            max_model_len=cfg.sampling.max_model_len,
            dtype="bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype,
            seed=cfg.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        engine_args = getattr(vllm, "EngineArgs", None)
        if engine_args is not None and dataclasses.is_dataclass(engine_args) and \
                "logprobs_mode" in {f.name for f in dataclasses.fields(engine_args)}:
            kwargs["logprobs_mode"] = "raw_logprobs"  # the default where it exists; V1 returned raw log-probs before it
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as e:
            log.debug("vLLM engine start failed", exc_info=True)
            raise UserError(f"vLLM could not start {cfg.model.name!r} ({_one_line(e)}); "
                            "check sampling.gpu_memory_utilization and sampling.max_model_len") from None
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
                   adapter=cfg.model.adapter, stop_ids=stop_ids, max_model_len=max_len)

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

    def load_adapter(self, path: str, version: int | None = None) -> None:
        """Serve the PEFT LoRA adapter in `path` from now on. The base model stays resident; the
        adapter gets a new LoRA name and id, is loaded into the engine now (so a bad adapter fails
        here, and `swap_s` measures the load), and the previous adapter is removed."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        p = Path(path)
        self._check_adapter(p)
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        request = LoRARequest(lora_name=f"v{version if version is not None else 0}", lora_int_id=lora_id,
                              lora_path=str(p.resolve()))
        engine = getattr(self.llm, "llm_engine", None)
        add = getattr(engine, "add_lora", None)
        if add is not None:  # otherwise vLLM loads it on the first request that names it
            try:
                add(request)
            except Exception as e:
                raise UserError(f"adapter {p} does not fit the base model: {_one_line(e)}") from None
        previous, self._lora = self._lora, request
        remove = getattr(engine, "remove_lora", None)
        if previous is not None and remove is not None:
            try:
                remove(previous.lora_int_id)
            except Exception as e:  # vLLM's LRU would evict it anyway
                log.debug("could not remove LoRA %s from vLLM: %s", previous.lora_int_id, _one_line(e))
        self.adapter_version = version
        self.swap_s = time.perf_counter() - t0
        log.info("vllm sampler: adapter %s (version %s, LoRA id %d) loaded in %.3f s", p, version, lora_id, self.swap_s)

    # ---------------------------------------------------------------- sampling

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, keys: list | None = None
    ) -> list[Completion]:
        """One completion per prompt, in order. `keys` is accepted and ignored: vLLM's automatic
        prefix caching reuses the KV cache of any shared prefix (within one adapter version)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError("one key per prompt")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if self.max_model_len is not None:
            longest = max(len(p) for p in prompts)
            if longest >= self.max_model_len:
                raise UserError(f"a prompt of {longest} tokens does not fit the vLLM engine's max_model_len "
                                f"{self.max_model_len}; raise sampling.max_model_len or shorten episodes (env.max_steps)")

        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        stop = sorted(self.stop_ids)
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [
            VLLMSamplingParams(
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                max_tokens=params.max_new_tokens,
                seed=None if seeds is None else int(seeds[i]),
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=stop,
                skip_special_tokens=True,
                detokenize=False,  # we decode with our tokenizer, exactly like the hf backend
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, sampling, lora_request=self._lora, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [self._completion(p, out) for p, out in zip(prompts, outputs)]

    def _completion(self, prompt: list[int], output) -> Completion:
        o = output.outputs[0]
        ids = [int(t) for t in o.token_ids]
        if o.logprobs is None or len(o.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs "
                               f"for {len(ids)} tokens")
        logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
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
