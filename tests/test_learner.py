"""The LoRA learner on a tiny random Llama: updates, adapter round-trip, hot-swap into the sampler."""

import copy
import random
from pathlib import Path

import pytest
import torch

from agentrl.env.data import Game
from agentrl.rollout.trajectory import Trajectory
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.config import LearnerConfig
from agentrl.train.learner import LocalLearner
from agentrl.train.loss import token_logprobs
from agentrl.weights import WeightsRef
from scripted import rows

GAME = Game("task/trial", "train", "pick_and_place_simple", None)


def sampled_trajectory(sampler, prompt, seed, index):
    c = sampler.generate(rows([prompt], seeds=[seed]), SamplingParams(1.0, 1.0, 6))[0]
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
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3))
    stats = learner.update([(t, 1.0) for t in trajectories])
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-4
    assert stats.step_tokens_trained == sum(sum(t.action_mask) for t in trajectories)
    assert stats.grad_l2_norm > 0 and not stats.skipped


def test_update_moves_logprobs_with_the_advantage_sign(tiny_model, trajectories):
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    pos, neg = trajectories[0], trajectories[1]
    before = [seq_logp(learner.model, t) for t in (pos, neg)]
    for _ in range(3):
        learner.update([(pos, 1.0), (neg, -1.0)])
    after = [seq_logp(learner.model, t) for t in (pos, neg)]
    assert after[0] > before[0] and after[1] < before[1]


def test_adapter_round_trip_and_hot_swap(tiny_model, tokenizer, trajectories, tmp_path):
    from peft import PeftModel

    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    learner.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    v1 = Path(learner.save(tmp_path / "adapters").path)
    learner.update([(trajectories[0], 1.0), (trajectories[2], -1.0)])
    v2 = Path(learner.save(tmp_path / "adapters").path)
    assert (v1.name, v2.name) == ("v1", "v2") and (v2 / "adapter_model.safetensors").is_file()
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".")]  # no temp dirs left

    ids = torch.tensor([trajectories[0].token_ids])
    with torch.no_grad():
        want = learner.model(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(v2)).eval()
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)

    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    sampler.load(WeightsRef(str(v1), 1))
    sampler.load(WeightsRef(str(v2), 2))
    assert list(sampler.model.peft_config) == ["v2"] and sampler.adapter_version == 2  # base stays, one adapter
    with torch.no_grad():
        assert torch.allclose(sampler.model(input_ids=ids).logits, want, atol=1e-5)
    out = sampler.generate(rows([trajectories[0].token_ids[:5]]), SamplingParams(0.0, 1.0, 3))
    assert out[0].adapter_version == 2


def test_the_sampler_serves_the_adapter_merged_and_swaps_restore_the_base_exactly(tiny_model, tokenizer, trajectories, tmp_path):
    """The hf sampler merges the adapter into its weights (fewer ops per token): it samples what the
    unmerged LoRA samples, and hot-swaps leave no rounding behind (the base is copied back)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.config import load_config
    from agentrl.errors import UserError

    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-2))
    learner.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    v1 = learner.save(tmp_path / "adapters").path
    learner.update([(trajectories[0], 1.0), (trajectories[2], -1.0)])
    v2 = learner.save(tmp_path / "adapters").path

    merged = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    unmerged = HFSampler.from_config(load_config(None, {"sampling.merge_adapter": False}), copy.deepcopy(tiny_model), tokenizer)
    assert merged.merge_adapter and not unmerged.merge_adapter
    merged.load(WeightsRef(str(v1), 1))
    weights = lambda s: {n: p.detach().clone() for n, p in s.model.named_parameters() if "lora_" not in n}  # noqa: E731
    at_v1 = weights(merged)
    merged.load(WeightsRef(str(v2), 2))
    unmerged.load(WeightsRef(str(v2), 2))
    layers = merged._lora_layers()
    assert layers and all(m.merged for _, m in layers) and not any(m.merged for _, m in unmerged._lora_layers())
    assert any(not torch.equal(p, at_v1[n]) for n, p in weights(merged).items())  # v2 is not v1

    prompts = [trajectories[0].token_ids[:5], trajectories[1].token_ids[:7]]
    for params in (SamplingParams(0.0, 1.0, 6), SamplingParams(1.0, 1.0, 6)):
        a = merged.generate(rows(prompts, seeds=[4, 5]), params)
        b = unmerged.generate(rows(prompts, seeds=[4, 5]), params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    with torch.no_grad():  # and it scores what the learner trains (its unmerged LoRA)
        ids = torch.tensor([trajectories[0].token_ids])
        assert torch.allclose(merged.model(input_ids=ids).logits, learner.model(input_ids=ids).logits, atol=1e-5)

    for _ in range(3):  # v1 -> v2 -> v1 ...: the weights at v1 are those of the first load, bit for bit
        merged.load(WeightsRef(str(v2), 2))
        merged.load(WeightsRef(str(v1), 1))
    assert all(torch.equal(p, at_v1[n]) for n, p in weights(merged).items())

    other = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match="does not fit the base model"):
        merged.load(WeightsRef(str(tmp_path / "other"), 3))
    assert merged.adapter_version == 1 and all(m.merged for _, m in merged._lora_layers() if "v1" in m.lora_A)
    assert all(torch.equal(p, at_v1[n]) for n, p in weights(merged).items())  # a failed load changes nothing


def test_zero_advantage_trajectories_cost_nothing_and_change_nothing(tiny_model, trajectories):
    """A = 0 contributes exactly zero gradient: such trajectories skip the forward pass, and a
    batch of only A = 0 (zero-variance groups) makes no optimizer step at all."""
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    before = {k: v.clone() for k, v in learner.model.named_parameters() if v.requires_grad}
    stats = learner.update([(t, 0.0) for t in trajectories])
    assert not stats.stepped and stats.step_tokens_trained == 0 and stats.grad_l2_norm == 0.0
    assert all(torch.equal(v, before[k]) for k, v in learner.model.named_parameters() if v.requires_grad)

    # mixed batch: same gradient as the nonzero part alone (seq-sum divides by the whole N)
    a = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    b = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=5e-3))
    sa = a.update([(trajectories[0], 1.0), (trajectories[1], -1.0), (trajectories[2], 0.0)])
    sb = b.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    assert sa.step_tokens_trained == sb.step_tokens_trained
    assert sa.grad_l2_norm == pytest.approx(sb.grad_l2_norm * 2 / 3, rel=1e-5)


@pytest.fixture
def four(tiny_model, tokenizer):
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    prompt = tokenizer("Thought: find the mug\nAction:", add_special_tokens=False).input_ids
    return [sampled_trajectory(sampler, prompt, seed, i) for i, seed in enumerate((1, 2, 3, 4))]


def lora_weights(learner):
    return [p.detach().clone() for p in learner.params]


def test_several_steps_per_iteration_take_todays_single_update_first(tiny_model, four):
    """epochs 2 x minibatches 2: the first of its 4 optimizer steps is exactly the single GRPO
    update of today's learner on that minibatch's trajectories; the later ones move further."""
    batch = [(four[0], 1.0), (four[1], -1.0), (four[2], 0.5), (four[3], -0.5)]
    single = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2))
    one = single.update(batch[:2])  # minibatch 1 of 2 in batch order (the first epoch keeps it)
    ppo = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, epochs=2, minibatches=2))
    after_first, real_step = [], ppo.optimizer.step

    def step(*a, **k):
        out = real_step(*a, **k)
        if not after_first:
            after_first.append(lora_weights(ppo))
        return out

    ppo.optimizer.step = step
    stats = ppo.update(batch)
    assert stats.optimizer_steps == 4 and one.optimizer_steps == 1
    assert stats.loss == pytest.approx(one.loss, abs=1e-7)  # the first step's loss is today's GRPO loss
    assert stats.grad_l2_norm == pytest.approx(one.grad_l2_norm, rel=1e-6)
    for a, b in zip(after_first[0], lora_weights(single)):
        assert torch.allclose(a, b, atol=1e-7, rtol=0)
    assert any(not torch.allclose(a, b) for a, b in zip(lora_weights(ppo), after_first[0]))  # then it moved on
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-4  # measured before the update


def test_under_raft_the_update_is_behaviour_cloning_on_the_wins(tiny_model, four):
    """`--advantage raft`: A = 1 on a win, 0 otherwise, so the update's loss is the teacher-forced
    NLL of the won replies over the whole batch's N (seq-sum), the losses cost nothing, and it
    raises the wins' log-probs; an all-success group trains in full."""
    from types import SimpleNamespace

    from agentrl.train.advantage import Advantage, batch_advantages

    for t, won in zip(four, (True, False, True, False)):
        t.stop_reason = "won" if won else "max_steps"
    group = SimpleNamespace(trajectories=four, cut=False, excluded_by=None, env_failed=False)
    batch = batch_advantages([group], Advantage("raft"))
    assert [a for _, a in batch] == [1.0, 0.0, 1.0, 0.0]
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2))
    wins = [four[0], four[2]]
    before = [seq_logp(learner.model, t) for t in wins]
    stats = learner.update(batch)
    assert stats.loss == pytest.approx(-sum(before) / len(four), rel=1e-5)
    assert stats.step_tokens_trained == sum(sum(t.action_mask) for t in wins)
    assert all(seq_logp(learner.model, t) > b for t, b in zip(wins, before))
    for t in four:
        t.stop_reason = "won"
    assert Advantage("raft").of_group(group) == [1.0] * len(four)


def test_a_cut_group_zeroed_in_the_batch_leaves_the_update_the_ungated_one(tiny_model, four):
    """`advantage.cut_groups`: a group with no win, cut by the gate, under `zero` enters at A = 0
    and counts in N, so the update equals the ungated run's (where it ran on and scored A = 0),
    weight for weight; under `drop` (the paper's) it leaves N, and the same wins' seq-sum loss
    grows by sampled / kept (the paper's section 4.4 dilution, removed)."""
    from types import SimpleNamespace

    from agentrl.train.advantage import Advantage, batch_advantages

    for t, won in zip(four, (True, False, False, False)):
        t.stop_reason = "won" if won else "max_steps"
    informative = SimpleNamespace(trajectories=four[:2], cut=False, excluded_by=None, env_failed=False)
    for estimator in ("raft", "grpo"):
        ran_on = SimpleNamespace(trajectories=four[2:], cut=False, excluded_by=None, env_failed=False)
        cut = SimpleNamespace(trajectories=four[2:], cut=True, excluded_by=None, env_failed=False)
        audited = SimpleNamespace(trajectories=four[2:], cut=False, excluded_by="cut", env_failed=False)
        ungated = batch_advantages([informative, ran_on], Advantage(estimator))
        zero = batch_advantages([informative, cut], Advantage(estimator, cut_groups="zero"))
        assert zero == ungated == batch_advantages([informative, audited], Advantage(estimator, cut_groups="zero"))
        drop = batch_advantages([informative, cut], Advantage(estimator))
        assert drop == ungated[:2]
        a, b, c = (LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2)) for _ in range(3))
        sa, sb, sc = a.update(ungated), b.update(zero), c.update(drop)
        assert all(torch.equal(x, y) for x, y in zip(lora_weights(a), lora_weights(b)))
        assert (sa.loss, sa.grad_l2_norm) == (sb.loss, sb.grad_l2_norm)
        assert sc.loss == pytest.approx(2 * sa.loss, rel=1e-6)  # N 4 -> 2: the kept rows' step doubles
        assert sc.grad_l2_norm == pytest.approx(2 * sa.grad_l2_norm, rel=1e-5)


def test_the_steps_mean_loss_and_gradient_norm_cover_every_optimizer_step(tiny_model, four):
    """`loss`/`grad_l2_norm` stay the first step's (comparable with single-step runs); `loss_mean`,
    `grad_l2_norm_mean` and `_max` are over every step the update took, the norms read here from
    the real learner's own step results; with one step all three equal the first's. A later step
    optimises PPO's clipped surrogate (-r A), whose value is another quantity than the first step's
    -A logp: `loss_mean` averages each step's loss in the first step's form. With the policy held
    still (lr 0) two epochs over the whole batch read the same loss twice."""
    batch = [(four[0], 1.0), (four[1], -1.0), (four[2], 0.5), (four[3], -0.5)]
    ppo = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, epochs=2, minibatches=2))
    results, real_step = [], ppo.step
    ppo.step = lambda *a, **k: results.append(real_step(*a, **k)) or results[-1]
    stats = ppo.update(batch)
    assert len(results) == stats.optimizer_steps == 4 and all(r.stepped for r in results)
    assert (stats.loss, stats.grad_l2_norm) == (results[0].loss, results[0].grad_norm)
    assert stats.grad_l2_norm_mean == pytest.approx(sum(r.grad_norm for r in results) / 4, rel=1e-12)
    assert stats.grad_l2_norm_max == max(r.grad_norm for r in results)
    assert len({r.grad_norm for r in results}) > 1  # the steps differ: the mean is not the first's
    one = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2)).update(batch)
    assert one.loss_mean == one.loss and one.grad_l2_norm_mean == one.grad_l2_norm == one.grad_l2_norm_max
    still = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=0.0, epochs=2, minibatches=1))
    results.clear()
    real_still = still.step
    still.step = lambda *a, **k: results.append(real_still(*a, **k)) or results[-1]
    held = still.update(batch)
    assert held.optimizer_steps == len(results) == 2
    assert held.loss_mean == pytest.approx(held.loss, rel=1e-5)  # -A logp at the same policy, twice
    assert results[1].loss != pytest.approx(results[0].loss, rel=1e-2)  # the surrogate's -r A at r = 1: not it
    assert held.grad_l2_norm_mean == pytest.approx(held.grad_l2_norm, rel=1e-5)


def test_one_epoch_one_minibatch_is_the_update_it_always_was(tiny_model, four):
    batch = [(t, a) for t, a in zip(four, (1.0, -1.0, 0.0, 0.5))]
    a, b = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2)), LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, clip=0.05))
    sa, sb = a.update(batch), b.update(batch)
    assert (sa.loss, sa.grad_l2_norm, sa.clip_fraction) == (sb.loss, sb.grad_l2_norm, 0.0)
    assert all(torch.equal(x, y) for x, y in zip(lora_weights(a), lora_weights(b)))  # the clip never acts on 1 x 1


def test_the_clip_bounds_the_ratio():
    """Constructed log-probs: with A > 0 a token whose ratio is above 1 + eps gives no gradient
    (its term is the constant (1 + eps) A); with A < 0 the same holds below 1 - eps; inside the
    band the term is r A."""
    from agentrl.train.loss import clipped_loss

    eps = 0.2
    old = torch.zeros((1, 4))
    logp = torch.tensor([[0.0, 0.5, -0.5, 0.1]], requires_grad=True)  # r = 1, 1.65, 0.61, 1.105
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, clipped = clipped_loss(logp, old, mask, torch.tensor([1.0]), eps, "seq-sum", n_total=1)
    r = torch.exp(logp.detach())[0]
    assert loss.item() == pytest.approx(-(min(float(r[1]), 1.2) + float(r[2]) + float(r[3])))  # A>0: 1.65 -> 1.2; 0.61 kept (min)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[1] == 0  # masked; clipped above (no gradient pushes r further up)
    assert float(g[2]) == pytest.approx(-float(r[2])) and float(g[3]) == pytest.approx(-float(r[3]))
    assert float(clipped) == pytest.approx(2 / 3)  # 1.65 and 0.61 lie outside [0.8, 1.2]
    logp.grad = None
    loss, _ = clipped_loss(logp, old, mask, torch.tensor([-1.0]), eps, "seq-sum", n_total=1)
    loss.backward()
    g = logp.grad[0]
    assert g[2] == 0 and float(g[1]) == pytest.approx(float(r[1])) and float(g[3]) == pytest.approx(float(r[3]))  # A<0: 0.61 clipped at 0.8


def test_kl_to_the_warm_start_is_zero_at_the_start_and_pulls_back(tiny_model, four, tmp_path):
    """With the warm start as reference, KL is 0 before any step (the policy is the reference) and
    positive after the policy moved; a large beta keeps the policy closer to the reference."""
    from peft import get_peft_model

    from agentrl.train.learner import lora_config

    warm = get_peft_model(copy.deepcopy(tiny_model), lora_config(cfg()))
    with torch.no_grad():
        for n, p in warm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a warm start that is not the zero init
    warm.save_pretrained(tmp_path / "warm")
    batch = [(four[0], 1.0), (four[1], -1.0)]
    drift = {}
    for beta in (0.0, 5.0):
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=2e-2, epochs=4, kl_coef=beta), init_adapter=str(tmp_path / "warm"))
        start = lora_weights(learner)
        stats = learner.update(batch)
        if beta:
            assert stats.kl is not None and stats.kl > 0  # steps 2-4 saw a moved policy
        drift[beta] = sum(float((a - b).pow(2).sum()) for a, b in zip(lora_weights(learner), start))
    assert drift[5.0] < drift[0.0]


def test_an_adapter_made_on_another_machine_is_saved_with_this_machines_base(tiny_model, tmp_path):
    """A warm start written on another machine names that machine's base model path; the adapters
    the learner writes from it name the base it really trains on, and saving looks nothing up
    (before: PEFT warned 'Could not find a config file in <the other path>' at every checkpoint)."""
    import json
    import warnings

    from peft import get_peft_model

    from agentrl.train.learner import lora_config

    base = tmp_path / "base"
    tiny_model.config.save_pretrained(base)
    model = copy.deepcopy(tiny_model)
    model.name_or_path = model.config._name_or_path = str(base)  # as from_pretrained(base) sets them
    warm = get_peft_model(copy.deepcopy(tiny_model), lora_config(cfg()))
    warm.save_pretrained(tmp_path / "warm")
    record = json.loads((tmp_path / "warm" / "adapter_config.json").read_text())
    record["base_model_name_or_path"] = "/elsewhere/cache/models/SmolLM2-135M-Instruct"
    (tmp_path / "warm" / "adapter_config.json").write_text(json.dumps(record))

    learner = LocalLearner(model, cfg(), init_adapter=str(tmp_path / "warm"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner._write_adapter(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(base)
    assert not [w for w in caught if "Could not find a config file" in str(w.message)]


def windowed_trajectory(sampler, tokenizer, history, seed, index, steps=4):
    """A multi-turn trajectory sampled the way ModelPolicy samples under prompt.history N: each
    reply from `window(traj, N)` (the opening and the last N turns), the ids kept whole."""
    from agentrl.rollout.trajectory import window

    t = Trajectory(game=GAME, index=index)
    t.append(tokenizer("Your task is to: put a mug in the sink.\n>", add_special_tokens=False).input_ids, generated=False)
    for k in range(steps):
        c = sampler.generate(rows([window(t, history)], seeds=[seed * 100 + k]), SamplingParams(1.0, 1.0, 5))[0]
        t.append(c.token_ids, generated=True, logprobs=c.logprobs)
        t.step_tokens.append(len(c.token_ids))
        t.append(tokenizer(f"\nYou see cabinet {k + 1}.\n>", add_special_tokens=False).input_ids, generated=False)
    return t


def test_windowed_trajectories_train_each_reply_on_the_window_it_was_sampled_from(tiny_model, tokenizer):
    """prompt.history 1: the learner's log-probs of every reply, taken over its own window, equal the
    sampler's (gap < 1e-4); read over the whole episode instead (history 0) they do not. All the
    trajectory's action tokens are trained, with a number (GRPO) or one advantage per reply (GiGPO)."""
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    trajs = [windowed_trajectory(sampler, tokenizer, 1, seed, i) for i, seed in enumerate((1, 2))]
    tokens = sum(sum(t.action_mask) for t in trajs)
    windowed = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3), prompt={"history": 1})
    stats = windowed.update([(trajs[0], 1.0), (trajs[1], -1.0)])
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-4
    assert stats.step_tokens_trained == tokens and stats.trajectories == 2  # N counts trajectories, not replies
    whole = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3), prompt={"history": 0})
    assert whole.update([(trajs[0], 1.0), (trajs[1], -1.0)]).logprob_gap > 1e-3  # not what was sampled
    per_step = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3), prompt={"history": 1})
    zero_first = [0.0, 0.5, -0.5, 1.0]
    stats = per_step.update([(trajs[0], zero_first), (trajs[1], [1.0] * 4)])
    assert stats.step_tokens_trained == tokens - trajs[0].step_tokens[0] and stats.logprob_gap < 1e-4


# ---------------------------------------------------------------- the Learner protocol's contract
def contract_items(n=4, seed=0):
    """Plain train items (token ids of the tiny model's vocabulary, an action mask, sampler log-probs)."""
    from agentrl.train.handoff import TrainItem

    rng = random.Random(seed)
    items = []
    for _ in range(n):
        prompt, reply = rng.randint(4, 9), rng.randint(2, 6)
        items.append(TrainItem([rng.randrange(1, 200) for _ in range(prompt + reply)], [0] * prompt + [1] * reply,
                               [0.0] * prompt + [-2.0] * reply, [reply]))
    return items


def learner_contract(learner, tmp_path) -> list:
    """What the loop relies on, whatever the layout (handoff.Learner's docstring); returns the
    numbers it saw, for comparing layouts."""
    from safetensors.torch import load_file

    from agentrl.train.handoff import Learner as LearnerProtocol
    from agentrl.train.handoff import UpdateStats
    from agentrl.weights import WeightsRef

    items = contract_items()
    batch = list(zip(items, (1.0, -1.0, 0.0, 0.5)))
    assert isinstance(learner, LearnerProtocol) and learner.version == 0
    first = learner.update(batch)
    assert isinstance(first, UpdateStats) and first.stepped and first.trajectories == 4
    assert first.step_tokens_trained == sum(sum(t.action_mask) for t, a in batch if a)
    ref = learner.save(tmp_path / "adapters")
    assert ref == WeightsRef(tmp_path / "adapters" / "v1", 1) and learner.version == 1
    assert (Path(ref.path) / "adapter_model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["v1"]  # complete, no temporary left
    nothing = learner.update([(t, 0.0) for t in items])  # no signal: no step, no version
    assert not nothing.stepped and nothing.optimizer_steps == 0 and learner.version == 1
    (tmp_path / "state").mkdir()
    learner.save_state(tmp_path / "state")
    after = learner.update(batch)  # from the saved state ...
    v2 = learner.save(tmp_path / "adapters")
    assert v2.version == learner.version == 2
    restored = learner.load_state(tmp_path / "state", 1)
    assert restored == WeightsRef(tmp_path / "state" / "adapter", 1) and learner.version == 1
    saved = load_file(str(Path(restored.path) / "adapter_model.safetensors"))
    assert saved.keys() == load_file(str(Path(ref.path) / "adapter_model.safetensors")).keys()
    again = learner.update(batch)  # ... the same update again: load_state restored it exactly
    assert (again.loss, again.grad_l2_norm, again.logprob_gap) == (after.loss, after.grad_l2_norm, after.logprob_gap)
    assert learner.save(tmp_path / "again").version == 2
    learner.close()
    return [(s.loss, s.grad_l2_norm, s.logprob_gap) for s in (first, after)]


@pytest.fixture(scope="module")
def contract_cfg(tiny_actor_dir):
    from agentrl.config import load_config

    return load_config(None, {"model.name": str(tiny_actor_dir), "learner.lora_r": 4, "learner.lora_alpha": 8,
                              "learner.target_modules": ["q_proj", "v_proj"], "learner.lr": 1e-2, "seed": 3})


def test_the_in_process_and_the_process_learner_keep_the_learner_contract_with_the_same_numbers(contract_cfg, tmp_path):
    """`make_learner` (colocate: in this process) and `RemoteLearner` (its own process) both keep
    handoff.Learner's contract, and train to the same numbers from the same config."""
    from agentrl.train.learner import LocalLearner
    from agentrl.train.remote import RemoteLearner, make_learner

    local = make_learner(contract_cfg)
    assert isinstance(local, LocalLearner)
    seen = learner_contract(local, tmp_path / "local")
    assert seen == learner_contract(RemoteLearner(contract_cfg), tmp_path / "process")


def test_a_step_on_any_loss_skips_non_finite_gradients(tiny_model, trajectories):
    """`step` (what sft's behaviour cloning trains through): gradients accumulate over the parts,
    the optimizer moves once; a non-finite loss moves nothing."""
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2))
    start = lora_weights(learner)

    def nll(model, t):
        ids = torch.tensor([t.token_ids])
        logp = token_logprobs(model, ids, torch.ones_like(ids))
        loss = -(logp * torch.tensor([t.action_mask])).sum()
        return loss, float(loss.detach())

    result = learner.step(trajectories, nll, max_norm=1.0)
    assert result.stepped and len(result.values) == 3 and result.loss == pytest.approx(sum(result.values))
    moved = lora_weights(learner)
    assert any(not torch.equal(a, b) for a, b in zip(moved, start))
    bad = learner.step(trajectories[:1], lambda m, t: (nll(m, t)[0] * float("nan"), None), max_norm=1.0)
    assert not bad.stepped and all(torch.equal(a, b) for a, b in zip(lora_weights(learner), moved))


def test_p_old_from_the_sampler_skips_the_pre_pass_and_is_the_same_update(tiny_model, four):
    """learner.old_logprobs sampler: the clipped ratio's p_old is the sampler's own log-probs
    (fp32, the same weights: equal to the pre-pass to float round-off), so the update runs no
    pre-pass and lands where the recomputed one does; the gap is still measured, on the first
    step's forward."""
    batch = [(four[0], 1.0), (four[1], -1.0), (four[2], 0.5), (four[3], -0.5)]
    arms, prepasses = {}, {}
    for source in ("learner", "sampler"):
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, epochs=2, minibatches=2, old_logprobs=source))
        calls, real = [], learner._logprobs
        learner._logprobs = lambda *a, **k: calls.append(1) or real(*a, **k)
        arms[source] = (learner.update(batch), lora_weights(learner))
        prepasses[source] = len(calls)
    assert prepasses == {"learner": 1, "sampler": 0}
    (s_l, w_l), (s_s, w_s) = arms["learner"], arms["sampler"]
    assert s_s.optimizer_steps == s_l.optimizer_steps == 4 and s_s.loss == pytest.approx(s_l.loss, abs=1e-7)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(w_l, w_s))
    assert s_s.logprob_gap is not None and s_s.logprob_gap < 1e-4


def test_p_old_from_the_sampler_is_what_the_ratio_reads(tiny_model, four):
    """Sampler log-probs shifted by -1 on every action token (a constructed stale sampler): with
    old_logprobs sampler the later steps' ratios sit near e and are clipped, and the gap reports the
    shift; the recomputed p_old never reads them (no clip beyond the policy's own movement)."""
    stale = []
    for t in four:
        s = copy.deepcopy(t)
        s.logprobs = [lp - 1.0 if m else lp for lp, m in zip(t.logprobs, t.action_mask)]
        stale.append(s)
    batch = [(stale[0], 1.0), (stale[1], -1.0), (stale[2], 0.5), (stale[3], -0.5)]
    out = {source: LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-4, minibatches=2, old_logprobs=source)).update(batch)
           for source in ("learner", "sampler")}
    assert out["sampler"].logprob_gap == pytest.approx(1.0, abs=1e-3)
    assert out["sampler"].clip_fraction >= 0.5 > out["learner"].clip_fraction  # 1 of 2 steps all clipped
    assert out["learner"].logprob_gap == pytest.approx(1.0, abs=1e-3)  # the pre-pass measures the same stale sampler


def test_old_logprobs_is_checked():
    from agentrl.config import load_config
    from agentrl.errors import UserError

    with pytest.raises(UserError, match="learner.old_logprobs must be one of learner, sampler"):
        load_config(None, {"learner.old_logprobs": "vllm"})


def test_the_update_reuses_the_heap_where_it_fits_and_lands_on_the_same_weights(tiny_model, four, monkeypatch):
    """learner.heap auto on a CPU: the update runs inside procmem.reused_heap() when its largest
    micro-batch's estimate, times the heap's fragmentation, fits what is free; not when it does not,
    nor under heap fixed or auto-sized micro-batches; either way the same update to the bit."""
    from agentrl.train import memory

    batch = [(four[0], 1.0), (four[1], -1.0), (four[2], 0.5), (four[3], -0.5)]
    arms, entered = {}, {}
    for name, heap, free in (("auto", "auto", 1 << 40), ("short", "auto", memory.RESERVE_BYTES + 1), ("fixed", "fixed", 1 << 40)):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device, free=free: free)
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, epochs=2, minibatches=2, heap=heap))
        calls, real = [], learner.heap
        learner.heap = lambda plan: calls.append(type(ctx := real(plan)).__name__) or ctx
        arms[name] = (learner.update(batch), lora_weights(learner))
        entered[name] = calls
    assert entered == {"auto": ["_GeneratorContextManager"], "short": ["nullcontext"], "fixed": ["nullcontext"]}
    for name in ("short", "fixed"):
        assert arms[name][0].loss == arms["auto"][0].loss
        assert all(torch.equal(a, b) for a, b in zip(arms[name][1], arms["auto"][1]))
    sized = LocalLearner(copy.deepcopy(tiny_model), cfg(tokens_per_microbatch="auto"))
    assert type(sized.heap([[len(t.token_ids) for t, _ in batch]])).__name__ == "nullcontext"  # it fills free memory: the fixed threshold bounds it


def test_the_heaps_fit_counts_its_fragmentation_and_checkpointing(monkeypatch):
    """memory.reused_heap_fits: the estimate times REUSED_HEAP_PEAK (larger with gradient
    checkpointing) against what is free less the reserve; never off the CPU."""
    from agentrl.train import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: memory.RESERVE_BYTES + (10 << 30))
    assert memory.reused_heap_fits(6 << 30, False, "cpu")  # 9.6 GB with the heap's fragmentation
    assert not memory.reused_heap_fits(6 << 30, True, "cpu")  # 24 GB
    assert not memory.reused_heap_fits(9 << 30, False, "cpu")
    assert not memory.reused_heap_fits(1, False, "meta")


def test_learner_heap_is_checked():
    from agentrl.config import load_config
    from agentrl.errors import UserError

    with pytest.raises(UserError, match="learner.heap must be one of auto, fixed"):
        load_config(None, {"learner.heap": "big"})
