"""The LoRA learner on a tiny random Llama: updates, adapter round-trip, hot-swap into the sampler."""

import copy

import pytest
import torch

from agentrl.env.data import Game
from agentrl.rollout.trajectory import Trajectory
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.config import LearnerConfig
from agentrl.train.learner import Learner
from agentrl.train.loss import token_logprobs

GAME = Game("task/trial", "train", "pick_and_place_simple", None)


def sampled_trajectory(sampler, prompt, seed, index):
    c = sampler.generate([prompt], SamplingParams(1.0, 1.0, 6), seeds=[seed])[0]
    t = Trajectory(game=GAME, index=index)
    t.append(prompt, generated=False)
    t.append(c.token_ids, generated=True, logprobs=c.logprobs)
    return t


@pytest.fixture
def trajectories(tiny_model, tokenizer):
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    prompt = tokenizer("Thought: find the mug\nAction:", add_special_tokens=False).input_ids
    return [sampled_trajectory(sampler, prompt, seed, i) for i, seed in enumerate((1, 2, 3))]


def cfg(**kw):
    return LearnerConfig(lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], micro_batch=2, **kw)


def seq_logp(model, traj):
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids))
    return float((lp[0] * torch.tensor(traj.action_mask)).sum())


def test_learner_sees_the_samplers_logprobs(tiny_model, trajectories):
    """LoRA starts at zero: before the update the learner's logp equals the sampler's (exact tokens)."""
    learner = Learner(copy.deepcopy(tiny_model), cfg(lr=1e-3))
    stats = learner.update([(t, 1.0) for t in trajectories])
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-4
    assert stats.step_tokens_trained == sum(sum(t.action_mask) for t in trajectories)
    assert stats.grad_l2_norm > 0 and not stats.skipped


def test_update_moves_logprobs_with_the_advantage_sign(tiny_model, trajectories):
    learner = Learner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    pos, neg = trajectories[0], trajectories[1]
    before = [seq_logp(learner.model, t) for t in (pos, neg)]
    for _ in range(3):
        learner.update([(pos, 1.0), (neg, -1.0)])
    after = [seq_logp(learner.model, t) for t in (pos, neg)]
    assert after[0] > before[0] and after[1] < before[1]


def test_adapter_round_trip_and_hot_swap(tiny_model, tokenizer, trajectories, tmp_path):
    from peft import PeftModel

    learner = Learner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    learner.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    v1 = learner.save_adapter(tmp_path / "adapters")
    learner.update([(trajectories[0], 1.0), (trajectories[2], -1.0)])
    v2 = learner.save_adapter(tmp_path / "adapters")
    assert (v1.name, v2.name) == ("v1", "v2") and (v2 / "adapter_model.safetensors").is_file()
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".")]  # no temp dirs left

    ids = torch.tensor([trajectories[0].token_ids])
    with torch.no_grad():
        want = learner.model(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(v2)).eval()
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)

    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    sampler.load_adapter(str(v1), version=1)
    sampler.load_adapter(str(v2), version=2)
    assert list(sampler.model.peft_config) == ["v2"] and sampler.adapter_version == 2  # base stays, one adapter
    with torch.no_grad():
        assert torch.allclose(sampler.model(input_ids=ids).logits, want, atol=1e-5)
    out = sampler.generate([trajectories[0].token_ids[:5]], SamplingParams(0.0, 1.0, 3))
    assert out[0].adapter_version == 2


def test_zero_advantage_trajectories_cost_nothing_and_change_nothing(tiny_model, trajectories):
    """A = 0 contributes exactly zero gradient: such trajectories skip the forward pass, and a
    batch of only A = 0 (zero-variance groups) makes no optimizer step at all."""
    learner = Learner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    before = {k: v.clone() for k, v in learner.model.named_parameters() if v.requires_grad}
    stats = learner.update([(t, 0.0) for t in trajectories])
    assert not stats.stepped and stats.step_tokens_trained == 0 and stats.grad_l2_norm == 0.0
    assert all(torch.equal(v, before[k]) for k, v in learner.model.named_parameters() if v.requires_grad)

    # mixed batch: same gradient as the nonzero part alone (seq-sum divides by the whole N)
    a = Learner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    b = Learner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    sa = a.update([(trajectories[0], 1.0), (trajectories[1], -1.0), (trajectories[2], 0.0)])
    sb = b.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    assert sa.step_tokens_trained == sb.step_tokens_trained
    assert sa.grad_l2_norm == pytest.approx(sb.grad_l2_norm * 2 / 3, rel=1e-5)
