"""GiGPO's step-level advantages (`--advantage gigpo`): the function on groups worked out by hand,
per-step advantages in the loss, anchor states of real rollouts, and a real-games train that
resumes exactly. The hand numbers follow verl-agent's gigpo/core_gigpo.py (29e3e8b): torch.std
(n - 1) with eps on the std, episode-level mean/std pooled over every step of the group, a step
group of one gets 0, a step's return includes its own reward, penalties are undiscounted."""

import math

import pytest
import torch

from agentrl.train.advantage import Advantage, anchor_states, batch_advantages, gigpo_step_advantages
from agentrl.rollout.trajectory import token_advantages, trained_tokens
from agentrl.train.loss import grpo_loss

EPS = 1e-6


def approx(rows):
    return [pytest.approx(r, abs=1e-6) for r in rows]


def test_shared_first_state_distinct_later_ones_gamma_below_one():
    # traj 0 wins in 2 steps, traj 1 fails in 4; only step 0 ("s0") is shared
    got = gigpo_step_advantages([1, 0], [["s0", "a"], ["s0", "b", "c", "d"]], gamma=0.9, omega=1.0)
    # episode level, pooled over the 6 step rows [1, 1, 0, 0, 0, 0]: mean 1/3, unbiased var (2*(2/3)^2 + 4*(1/3)^2)/5
    std = math.sqrt(4 / 15)
    e0, e1 = (2 / 3) / (std + EPS), (-1 / 3) / (std + EPS)
    # step level: returns at s0 are 0.9 (traj 0: gamma * 1) and 0; mean 0.45, std 0.45*sqrt(2); the rest are groups of one: 0
    s = 0.45 / (0.45 * math.sqrt(2) + EPS)
    assert got == approx([[e0 + s, e0], [e1 - s, e1, e1, e1]])


def test_without_std_and_a_smaller_step_weight():
    got = gigpo_step_advantages([1, 0], [["s0", "a"], ["s0", "b", "c", "d"]], gamma=0.9, omega=0.5, std_norm=False)
    assert got == approx([[2 / 3 + 0.5 * 0.45, 2 / 3], [-1 / 3 - 0.5 * 0.45, -1 / 3, -1 / 3, -1 / 3]])


def test_a_state_revisited_within_and_across_trajectories_is_one_step_group():
    # traj 0 sees "x" at steps 1 and 2 (e.g. "Nothing happens."): both cells join one step group
    got = gigpo_step_advantages([1, 0], [["s0", "x", "x"], ["s0", "y"]], gamma=0.5, omega=1.0)
    std_e = math.sqrt((3 * 0.4**2 + 2 * 0.6**2) / 4)  # rows [1, 1, 1, 0, 0], mean 0.6
    e0, e1 = 0.4 / (std_e + EPS), -0.6 / (std_e + EPS)
    s0 = 0.125 / (0.125 * math.sqrt(2) + EPS)  # s0: returns 0.25 and 0
    x = 0.25 / (0.25 * math.sqrt(2) + EPS)  # x: returns 0.5 (step 1) and 1 (step 2), mean 0.75
    assert got == approx([[e0 + s0, e0 - x, e0 + x], [e1 - s0, e1]])  # "y" alone: 0


def test_equal_rewards_and_lengths_give_zero():
    states = [["s0", "a", "b"], ["s0", "c", "d"], ["s0", "a", "e"]]
    for r in (0.0, 1.0):
        for gamma in (1.0, 0.95):
            assert gigpo_step_advantages([r] * 3, states, gamma, 1.0) == [[0.0] * 3] * 3


def test_all_success_group_of_different_lengths_has_step_signal_only_with_discounting():
    states = [["s0"], ["s0", "b", "c"]]
    got = gigpo_step_advantages([1, 1], states, gamma=0.9, omega=1.0)
    s = 0.095 / (0.19 / math.sqrt(2) + EPS)  # s0: returns 1 (won at once) and 0.81
    assert got == approx([[s], [-s, 0.0, 0.0]])  # the episode level is 0: same reward everywhere
    assert got[0][0] > 0 > got[1][0]  # the shorter path is preferred at the shared state
    assert gigpo_step_advantages([1, 1], states, gamma=1.0, omega=1.0) == [[0.0], [0.0, 0.0, 0.0]]


def test_penalties_land_on_their_step_undiscounted():
    got = gigpo_step_advantages([0, 0], [["s0", "a"], ["s0", "b"]], gamma=0.9, omega=1.0, std_norm=False,
                                penalties=[[0.1, 0.0], [0.0, 0.0]])
    # rows [-0.1, 0, 0, 0] mean -0.025; returns at s0: -0.1 and 0 (mean -0.05); step 1 of traj 0 keeps return 0
    assert got == approx([[-0.075 - 0.05, 0.025], [0.025 + 0.05, 0.025]])


def test_explicit_step_rewards_are_discounted():
    got = gigpo_step_advantages([1, 0], [["s0", "a"], ["s0", "b"]], gamma=0.5, omega=1.0, std_norm=False,
                                step_rewards=[[0.2, 1.0], [0.0, 0.0]])
    # returns at s0: 0.2 + 0.5 * 1 = 0.7 and 0 (mean 0.35); episode rows [1, 1, 0, 0] mean 0.5
    assert got == approx([[0.5 + 0.35, 0.5], [-0.5 - 0.35, -0.5]])


def test_a_single_step_row_keeps_its_raw_score():
    # core_gigpo.py L225-227: a group of one row gets mean 0 and std 1 at the episode level
    assert gigpo_step_advantages([1], [["s0"]], 0.95, 1.0) == approx([[1 / (1 + EPS)]])
    with pytest.raises(ValueError, match="one entry per step"):
        gigpo_step_advantages([1, 0], [["s0"], ["s0"]], 0.95, 1.0, step_rewards=[[1.0], []])


# ---------------------------------------------------------------- the loss
@pytest.mark.parametrize("agg", ["seq-sum", "token-mean", "seq-mean-token-mean"])
def test_loss_with_per_token_advantages_equals_a_direct_computation(agg):
    logp = torch.tensor([[0.0, -1.0, -2.0, -3.0, -0.5], [0.0, -0.5, -0.25, -4.0, -1.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]])
    adv = torch.tensor([[9.0, 2.0, 2.0, 9.0, -1.0], [9.0, 9.0, 0.5, -3.0, 9.0]])  # 9: off the mask, must not count
    w0, w1 = 2 * -1.0 + 2 * -2.0 + -1 * -0.5, 0.5 * -0.25 + -3.0 * -4.0  # sum of m * A * logp per row
    expected = {"seq-sum": -(w0 + w1) / 2, "token-mean": -(w0 + w1) / 5, "seq-mean-token-mean": -(w0 / 3 + w1 / 2) / 2}[agg]
    assert grpo_loss(logp, mask, adv, agg).item() == pytest.approx(expected)
    # a per-token advantage constant within each row is the per-trajectory loss exactly
    flat = torch.tensor([1.5, -0.5])
    assert grpo_loss(logp, mask, flat[:, None].expand(-1, 5), agg).item() == pytest.approx(grpo_loss(logp, mask, flat, agg).item())


def test_per_token_advantages_give_zero_gradient_off_the_action_mask():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 1]])
    adv = torch.randn(mask.shape)
    logp = torch.randn(mask.shape, requires_grad=True)
    grpo_loss(logp, mask, adv, "seq-sum").backward()
    assert torch.all(logp.grad[mask == 0] == 0) and torch.all(logp.grad[mask == 1] != 0)


def test_a_steps_advantage_lands_on_exactly_its_reply_tokens():
    from types import SimpleNamespace

    # prompt(3) reply0(2) obs(2) reply1(0: an empty reply) obs(1) reply2(3)
    traj = SimpleNamespace(action_mask=[0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], step_tokens=[2, 0, 3])
    assert token_advantages(traj, [0.5, 7.0, -1.0]) == [0, 0, 0, 0.5, 0.5, 0, 0, 0, -1.0, -1.0, -1.0]
    assert token_advantages(traj, 2.0) == [0, 0, 0, 2, 2, 0, 0, 0, 2, 2, 2]
    assert trained_tokens(traj, [0.0, 7.0, -1.0]) == 3 and trained_tokens(traj, 0.0) == 0
    with pytest.raises(ValueError, match="2 step advantages for 3 replies"):
        token_advantages(traj, [1.0, 2.0])


# ---------------------------------------------------------------- real rollouts
@pytest.fixture(scope="module")
def real_rollout(games, tiny_model, tokenizer):
    """G=3 trajectories on each of two real games, sampled by the tiny model (fuzzy threshold 0:
    every reply maps to some admissible command)."""
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.hf import HFSampler

    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 6), seed=5)
    return run_lockstep([games["pick_and_place_simple"], games["look_at_obj_in_light"]], policy, max_steps=3,
                        fuzzy_threshold=0, group_size=3)


def test_real_trajectories_of_one_game_share_step_zeros_state(real_rollout):
    first = [anchor_states(g.trajectories[0])[0] for g in real_rollout.groups]
    assert first[0] != first[1]  # two games, two initial observations
    for g in real_rollout.groups:
        for t in g.trajectories:
            anchors = anchor_states(t)
            assert len(anchors) == len(t.step_tokens) == len(t.steps) == 3
            assert anchors[0] == t.initial_observation == g.trajectories[0].initial_observation
            assert anchors[1:] == [s.observation for s in t.steps[:2]]
        assert Advantage("gigpo").step_group_sizes(g)[0] == 3  # step 0's group holds all G


def test_gigpo_batch_on_real_groups(real_rollout):
    """Every trajectory gets one advantage per reply; with a win reward forced on one trajectory
    the signs follow it; tokens get exactly their step's value."""
    import copy

    g = copy.deepcopy(real_rollout.groups[0])
    winner = g.trajectories[1]
    winner.stop_reason = "won"  # as if its last step had won
    batch = batch_advantages([g], Advantage("gigpo", gamma=0.9))
    by_index = {t.index: a for t, a in batch}
    assert [len(a) for a in by_index.values()] == [3, 3, 3]
    assert all(x > 0 for x in by_index[1]) and all(x < 0 for x in by_index[0] + by_index[2])
    per_token = token_advantages(winner, by_index[1])
    assert [x for x, m in zip(per_token, winner.action_mask) if m] == [a for a, n in zip(by_index[1], winner.step_tokens)
                                                                         for _ in range(n)]


def test_invalid_action_penalty_reaches_grpo_and_gigpo(real_rollout):
    """One reply that maps to no admissible command, in a group that otherwise acted validly and
    saw distinct observations after step 0 (so only step 0 is a shared state)."""
    import copy

    g = copy.deepcopy(real_rollout.groups[1])
    for t in g.trajectories:
        for k, s in enumerate(t.steps):
            s.command, s.observation = "look", f"obs {t.index} {k}"
    g.trajectories[0].steps[1].command = None
    by_index = lambda fn: {t.index: a for t, a in batch_advantages([g], fn)}  # noqa: E731
    assert by_index(Advantage("dr_grpo", invalid_action=-0.1)) == pytest.approx({0: -0.1 * 2 / 3, 1: 0.1 / 3, 2: 0.1 / 3})
    assert by_index(Advantage("gigpo", std_norm=False)) == {0: [0.0] * 3, 1: [0.0] * 3, 2: [0.0] * 3}
    gigpo = by_index(Advantage("gigpo", std_norm=False, invalid_action=-0.1))
    m = 0.1 / 9  # minus the mean of the nine step rows, one of them -0.1; step 0's returns are all 0
    assert gigpo == {0: approx([m, -0.1 + m, m]), 1: approx([m] * 3), 2: approx([m] * 3)}


def test_invalid_action_penalty_in_the_advantage_keeps_zero_variance_groups_out(real_rollout):
    """reward.invalid_action_in advantage: the outcome's advantage first (std-normalised), then the
    penalty on each invalid reply, and only where the group's outcomes differ."""
    import copy

    g = copy.deepcopy(real_rollout.groups[1])
    for t in g.trajectories:
        t.stop_reason = "max_steps"
        for s in t.steps:
            s.command = "look"
    g.trajectories[0].steps[1].command = None
    step_pen = Advantage("grpo", invalid_action=-0.1, invalid_action_in="advantage")
    by_index = lambda fn: {t.index: a for t, a in batch_advantages([g], fn)}  # noqa: E731
    assert by_index(step_pen) == {0: 0.0, 1: 0.0, 2: 0.0}  # all lost: no signal, invalid reply or not
    assert by_index(Advantage("grpo", invalid_action=-0.1))[0] < 0  # in the return it makes a signal of its own
    g.trajectories[1].stop_reason = "won"
    win, lose = 2 / math.sqrt(2), -1 / math.sqrt(2)  # rewards 0, 1, 0: mean 1/3, std sqrt(2)/3
    got = by_index(step_pen)
    assert got[0] == pytest.approx([lose, lose - 0.1, lose], abs=1e-5) and got[1] == pytest.approx(win, abs=1e-5)
    assert got[2] == pytest.approx(lose, abs=1e-5) and not isinstance(got[2], list)  # nothing added: stays one number


def test_cut_replies_are_masked_out_of_every_estimator(real_rollout):
    """advantage.mask_cut_replies: a reply cut at max_new_tokens gets A = 0 on exactly its own
    tokens, under GRPO and GiGPO; a zero-variance group stays 0 (one number, skipped)."""
    import copy

    g = copy.deepcopy(real_rollout.groups[1])
    for t in g.trajectories:  # the tiny random model's replies all ran to max_new_tokens: keep one cut
        t.stop_reason, t.cut_steps = "max_steps", []
    cut = g.trajectories[0]
    cut.cut_steps = [2]
    masked = Advantage("grpo", mask_cut_replies=True)
    assert {t.index: a for t, a in batch_advantages([g], masked)} == {0: 0.0, 1: 0.0, 2: 0.0}
    cut.stop_reason = "won"
    got = {t.index: a for t, a in batch_advantages([g], masked)}
    assert got[0] == pytest.approx([2 / math.sqrt(2)] * 2 + [0.0], abs=1e-5) and not isinstance(got[1], list)
    per_token = [x for x, m in zip(token_advantages(cut, got[0]), cut.action_mask) if m]
    n0, n1, n2 = cut.step_tokens
    assert per_token[: n0 + n1] == pytest.approx([2 / math.sqrt(2)] * (n0 + n1), abs=1e-5) and per_token[n0 + n1:] == [0.0] * n2
    assert trained_tokens(cut, got[0]) == n0 + n1
    gigpo = {t.index: a for t, a in batch_advantages([g], Advantage("gigpo", mask_cut_replies=True))}
    plain = {t.index: a for t, a in batch_advantages([g], Advantage("gigpo"))}
    assert gigpo[0] == plain[0][:2] + [0.0] and gigpo[1] == plain[1]


class WalkthroughScript:
    """Plays real ALFWorld games by their expert walkthroughs, so a test gets wins on any CPU (a
    tiny random model never wins a real game). A fake only in that choice: it wraps the real
    `ScriptedSampler` of tests/scripted.py, whose replies carry the real model's token ids and
    log-probs (teacher-forced), so the learner, the swap and the loss see real samples.
    Games in `stall` reply without an action every step (converged: the gate's case). Elsewhere
    trajectory i first takes i detour steps (`look`, `inventory`), then the walkthrough: the whole
    group wins, in different numbers of steps (no signal for GRPO, step-level signal for GiGPO)."""

    def __init__(self, walkthroughs: dict, stall: set):
        self.walkthroughs, self.stall, self.seen = walkthroughs, stall, {}

    def reply(self, prompt, key):
        game_id, index = key
        last = self.seen.get(key)  # a shorter prompt than last time: a new episode of this row
        step = 0 if last is None or len(prompt) <= last[0] else last[1] + 1
        self.seen[key] = (len(prompt), step)
        plan = ["look", "inventory"][:index] + list(self.walkthroughs[game_id])
        if game_id in self.stall or step >= len(plan):
            return "Thought: I wait."
        return f"Thought: next.\nAction: {plan[step]}"


@pytest.fixture
def walkthrough_sampler(monkeypatch, data_root):
    import agentrl.sampling as sampling
    from agentrl.env import find_games
    from scripted import ScriptedSampler

    pool = find_games("alfworld", "train", data_root, ["pick_and_place_simple"])
    ids = sorted(g.game_id for g in pool)
    script = WalkthroughScript({g.game_id: g.walkthrough for g in pool}, set(ids[::2]))
    real = sampling.make_sampler

    def make(cfg, *args, **kwargs):
        sampler = ScriptedSampler(real(cfg, *args, **kwargs))
        sampler.reply = script.reply
        return sampler

    monkeypatch.setattr(sampling, "make_sampler", make)
    return script


GIGPO_RUN = {"env.kind": "alfworld", "rollout.split": "train", "rollout.task_types": ["pick_and_place_simple"],
             "env.max_steps": 12, "rollout.tasks": 2, "rollout.group_size": 3, "train.iterations": 2, "rollout.gate": "3,0.12",
             "select.gate_audit": 0.5, "train.advantage": "gigpo", "train.eval_tasks": 0, "env.fuzzy_threshold": 85.0,
             "reward.invalid_action": -0.01, "learner.lr": 2e-3, "sampling.max_new_tokens": 32}


def test_gigpo_trains_on_real_games_with_the_gate_and_resumes_exactly(tmp_path, tiny_actor_dir, walkthrough_sampler):
    """`agentrl train --advantage gigpo` on real ALFWorld games, the gate with its audit on:
    all-success groups of different lengths train (GRPO would skip them: zero variance), the
    stalled groups are cut or audited, every iteration's step-tokens add up, the advantage mass is
    reported, and 1 iteration + resume equal 2 straight."""
    from test_train_loop import read_metrics, run_train, tiny_cfg

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, tiny_cfg(tiny_actor_dir, **GIGPO_RUN))
    rows = [r for r in read_metrics(straight) if r["kind"] == "iteration"]
    assert len(rows) == 2
    for r in rows:
        assert r["step_tokens_generated"] + r["step_tokens_carried"] == (
            r["step_tokens_trained"] + r["step_tokens_excluded_by_stages"] + r["step_tokens_zero_advantage"])
        m = r["advantage_mass"]
        assert m["kept_groups"] + m["audited_groups"] + m["cut_groups"] == r["groups"] == 2
        assert r["zero_variance_all_success"] == m["kept_groups"]  # every walked group won whole ...
        assert (m["kept_l2"] > 0) == (m["kept_groups"] > 0) == (r["step_tokens_trained"] > 0)  # ... and still trained
    assert sum(r["advantage_mass"]["kept_groups"] for r in rows) > 0
    assert sum(r["advantage_mass"]["cut_groups"] + r["advantage_mass"]["audited_groups"] for r in rows) > 0
    run_train(resumed, tiny_cfg(tiny_actor_dir, **GIGPO_RUN | {"train.iterations": 1}))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **GIGPO_RUN), resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]  # noqa: E731
    assert strip(read_metrics(resumed)) == strip(read_metrics(straight))
