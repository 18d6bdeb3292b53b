"""ArrolStage: ARRoL inside a rollout (features from the policy, pruning at step K, training in observe)."""

import pytest
import torch

from agentrl.rollout.lockstep import Group
from agentrl.rollout.trajectory import Step, Trajectory
from agentrl.select.arrol_stage import ArrolStage
from agentrl.select.base import Stage

TEXTS = [
    "You are in the middle of a room. Looking quickly around you, you see a desk 1.",
    "Action: go to desk 1",
    "On the desk 1, you see a pen 1, a lamp 2 and a book 3.",
    "Thought: the lamp is here.\nAction: use desklamp 1",
    "Nothing happens.",
    "Action: take book 3 from desk 1",
    "You pick up the book 3 from the desk 1.",
]


def _traj(game, tokenizer, i, steps=1, tokens_per_step=(5,)):
    """A trajectory at the end of its step-`steps` turn (token ids of real text, lengths differ)."""
    t = Trajectory(game=game, index=i)
    t.token_ids = tokenizer.encode(" ".join(TEXTS[: 1 + i % len(TEXTS)]) + f" ({i})")
    t.action_mask = [0] * len(t.token_ids)
    t.steps = [Step("Action: look", "look", "look", "Nothing happens.", False, False) for _ in range(steps)]
    t.step_tokens = [tokens_per_step[j % len(tokens_per_step)] for j in range(steps)]
    return t


def _group(game, tokenizer, n, **kw):
    return Group(game, [_traj(game, tokenizer, i, **kw) for i in range(n)])


def test_batched_features_equal_one_by_one(tiny_model, tokenizer, games):
    game = games["look_at_obj_in_light"]
    trajs = [_traj(game, tokenizer, i) for i in range(7)]
    assert len({len(t.token_ids) for t in trajs}) > 3  # real padding
    stage = ArrolStage(tiny_model, K=1, batch_size=4)  # two batches, the second ragged
    batched = stage.features(trajs)
    assert batched.shape == (7, tiny_model.config.hidden_size)
    assert batched.dtype == torch.float32 and batched.device.type == "cpu" and not batched.requires_grad
    single = torch.cat([stage.features([t]) for t in trajs])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=0)
    # the last layer's state at the last token, as the model computes it unpadded
    with torch.no_grad():
        ref = tiny_model(input_ids=torch.tensor([trajs[3].token_ids]), output_hidden_states=True)
    ref = ref.hidden_states[-1][0, -1]
    torch.testing.assert_close(batched[3], ref, atol=1e-5, rtol=0)
    assert isinstance(stage, Stage) and stage.name == "arrol" and stage.point == "step"


def test_cold_start_records_features_and_trains_the_head(tiny_model, tokenizer, games):
    game = games["look_at_obj_in_light"]
    stage = ArrolStage(tiny_model, K=2, cold_start=2, train_steps=2)
    for it in (1, 2):  # iterations 1..cold_start: no pruning
        stage.begin(it)
        group = _group(game, tokenizer, 6, steps=2)
        stage.at_step(1, group)  # not K: nothing
        assert not stage._recorded
        stage.at_step(2, group)
        assert len(group.trajectories) == 6 and not group.pruned
        assert all(t.stop_reason is None for t in group.trajectories)
        assert len(stage._recorded) == 6
        for i, t in enumerate(group.trajectories):
            t.stop_reason = "won" if i % 2 else "lost"
        stage.observe([group])
        assert len(stage.arrol.rewards) == 6 * it  # the head's replay buffer grew
        assert stage.arrol.updates == it and stage.arrol.iteration == it
        assert stage.stats().decisions == {"trajectories_pruned": 0, "groups_pruned": 0}
        assert stage.stats().extra["buffer_rows"] == 6 * it
    assert stage.arrol.rewards.tolist() == [0.0, 1.0] * 6


def test_after_cold_start_half_the_group_is_pruned(tiny_model, tokenizer, games):
    game = games["look_at_obj_in_light"]
    stage = ArrolStage(tiny_model, K=2, kappa=0.5, cold_start=1, max_steps=10, train_steps=2, rule="deterministic")
    stage.begin(1)
    warm = _group(game, tokenizer, 6, steps=2)
    stage.at_step(2, warm)
    for i, t in enumerate(warm.trajectories):
        t.stop_reason = "won" if i < 3 else "lost"
    stage.observe([warm])

    stage.begin(2)
    group = _group(game, tokenizer, 6, steps=2, tokens_per_step=(4, 6))  # 5 tokens per step on average
    before = list(group.trajectories)
    expected = stage.arrol.keep(stage.arrol.predict(stage.features(before)))
    stage.at_step(2, group)
    assert sum(expected) == 3
    assert group.trajectories == [t for t, k in zip(before, expected) if k]
    assert all(a is b for a, b in zip(group.trajectories, [t for t, k in zip(before, expected) if k]))
    assert [id(t) for t in group.pruned] == [id(t) for t, k in zip(before, expected) if not k]
    assert all(t.stop_reason == "pruned" for t in group.pruned)
    assert all(t.stop_reason is None for t in group.trajectories)
    assert group.step_tokens == 6 * 10  # the pruned ones were paid for
    s = stage.stats()
    assert s.decisions == {"trajectories_pruned": 3, "groups_pruned": 1}
    assert s.step_tokens_generated == s.step_tokens_excluded == 3 * 10
    assert s.step_tokens_avoided == 3 * 5 * (10 - 2)

    # a group with fewer than 3 trajectories running at K is left alone (and not recorded)
    small = _group(game, tokenizer, 4, steps=2)
    small.trajectories[0].stop_reason = small.trajectories[1].stop_reason = "won"
    recorded = len(stage._recorded)
    stage.at_step(2, small)
    assert len(small.trajectories) == 4 and not small.pruned and len(stage._recorded) == recorded
    assert stage.stats().decisions["trajectories_pruned"] == 3

    # observe trains on the kept trajectories that finished, never on the pruned ones
    rows = len(stage.arrol.rewards)
    group.trajectories[0].stop_reason = "won"
    group.trajectories[1].stop_reason = "max_steps"
    group.trajectories[2].stop_reason = "env_error"  # no outcome of its own
    stage.observe([group, small])
    assert len(stage.arrol.rewards) == rows + 2
    assert stage.arrol.rewards[-2:].tolist() == [1.0, 0.0]
    assert stage.stats().decisions["trajectories_pruned"] == 3  # the iteration observe closed


def test_state_dict_round_trip(tiny_model, tokenizer, games):
    game = games["look_at_obj_in_light"]
    stage = ArrolStage(tiny_model, K=1, cold_start=0, train_steps=2)
    group = _group(game, tokenizer, 4)
    stage.begin(1)
    stage.at_step(1, group)
    for i, t in enumerate(group.trajectories):
        t.stop_reason = "won" if i % 2 else "lost"
    stage.observe([group])
    other = ArrolStage(tiny_model, K=1, cold_start=0, seed=5)
    other.load_state_dict(stage.state_dict())
    feats = stage.features(_group(game, tokenizer, 5).trajectories)
    assert other.arrol.predict(feats).tolist() == pytest.approx(stage.arrol.predict(feats).tolist())
    assert other.arrol.iteration == 1 and len(other.arrol.rewards) == len(group.trajectories)


def test_sampler_as_model_follows_its_current_model(tiny_model, tokenizer):
    from agentrl.sampling.hf import HFSampler

    sampler = HFSampler(tiny_model, tokenizer)
    stage = ArrolStage(sampler, K=1)
    assert stage.model is tiny_model and stage.arrol.hidden_size == tiny_model.config.hidden_size


def test_rollout_prunes_half_of_a_real_group_at_step_1(tiny_model, tokenizer, games):
    from agentrl.env.alfworld import AlfworldEnv
    from agentrl.env.pool import LocalEnvs
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.hf import HFSampler

    envs = LocalEnvs(AlfworldEnv)
    sent = []  # (op, handles) the rollout asked of the envs
    submit = envs.submit
    envs.submit = lambda op, items: sent.append((op, [h for h, _ in items])) or submit(op, items)
    stage = ArrolStage(tiny_model, K=1, kappa=0.5, cold_start=0, max_steps=3, train_steps=2, rule="deterministic")
    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 8), seed=1)
    rollout = run_lockstep([games["look_at_obj_in_light"]], policy, max_steps=3, fuzzy_threshold=0, group_size=6,
                           envs=envs, stages=[stage])
    (group,) = rollout.groups
    assert len(group.trajectories) == 3 and len(group.pruned) == 3
    assert all(len(t.steps) == 1 and t.stop_reason == "pruned" for t in group.pruned)
    assert all(t.done for t in group.trajectories + group.pruned)
    assert all(t.stop_reason != "pruned" for t in group.trajectories)
    assert sorted(t.index for t in group.trajectories + group.pruned) == list(range(6))
    assert rollout.stats.step_tokens == group.step_tokens  # pruned tokens counted once, as generated
    # the pruned trajectories' envs were released right after step 1 and never stepped again
    pruned = {t.index for t in group.pruned}
    steps = [handles for op, handles in sent if op == "step"]
    assert set(steps[0]) == set(range(6))
    assert all(not pruned & set(h) for h in steps[1:])
    first_release = next(handles for op, handles in sent if op == "release")
    assert pruned <= set(first_release)
    assert envs._envs == {}  # every env released at the end
    # tokens end where the rollout stopped: a pruned trajectory has one reply, its observation after
    assert all(sum(t.action_mask) == t.step_tokens[0] for t in group.pruned)
    assert stage.stats().decisions == {"trajectories_pruned": 3, "groups_pruned": 1}
    stage.observe(rollout.groups)
    assert len(stage.arrol.rewards) == 3  # the kept trajectories' outcomes train the head
