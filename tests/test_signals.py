import math

import pytest

from agentrl.collect import write_rollout
from agentrl.env.alfworld import AlfworldEnv
from agentrl.errors import UserError
from agentrl.rollout.lockstep import run_lockstep
from agentrl.rollout.signals import SIGNALS, Trace, compute_signals, d_K, reply_logprobs, signals_at
from agentrl.select.gate_rule import Threshold
from agentrl.specs import GateSpec, convergence_score, parse_gate
from agentrl.train.offpolicy import load_buffer


def test_identical_prefixes_are_zero():
    a = ["go to desk 1", "take pen 1 from desk 1"]
    s = compute_signals([a, a, a, a], ["o", "o", "o", "o"], [False] * 4)
    assert s["prefix_edit_distance_mean"] == 0.0
    assert s["action_bigram_jaccard_mean"] == 0.0
    assert s["unique_prefix_ratio"] == 0.25 and s["unique_action_ratio"] == 0.25
    assert s["action_entropy"] == 0.0 and s["obs_unique_ratio"] == 0.25
    assert s["termination_fraction"] == 0.0
    assert list(s) == list(SIGNALS)


def test_all_different_prefixes_are_one():
    acts = [[f"a{i}", f"b{i}", f"c{i}"] for i in range(4)]
    s = compute_signals(acts, [f"o{i}" for i in range(4)], [True, False, False, False])
    assert s["prefix_edit_distance_mean"] == 1.0
    assert s["action_bigram_jaccard_mean"] == 1.0
    assert s["unique_prefix_ratio"] == s["unique_action_ratio"] == s["obs_unique_ratio"] == 1.0
    assert s["action_entropy"] == pytest.approx(1.0)
    assert s["termination_fraction"] == 0.25


def test_known_values_and_finished_early():
    # pairs: (x y z, x y) = 1/3; (x y z, x q z) = 1/3; (x y, x q z) = 2/3 -> mean 4/9
    acts = [["x", "y", "z"], ["x", "y"], ["x", "q", "z"]]
    assert d_K(acts) == pytest.approx(4 / 9)
    s = compute_signals(acts, ["o1", "o1", "o2"], [False, True, False])
    # bigrams: {xy,yz}, {xy}, {xq,qz}: 1-1/2, 1-0/4, 1-0/3 -> (0.5+1+1)/3
    assert s["action_bigram_jaccard_mean"] == pytest.approx(2.5 / 3)
    # last actions z, y, z: entropy of (2/3, 1/3) / log 3
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(3)
    assert s["action_entropy"] == pytest.approx(h)
    assert s["unique_action_ratio"] == pytest.approx(2 / 3) and s["obs_unique_ratio"] == pytest.approx(2 / 3)
    assert s["termination_fraction"] == pytest.approx(1 / 3)


def test_empty_prefixes():
    s = compute_signals([[], [], []], ["o", "o", "o"], [False] * 3)
    assert s["prefix_edit_distance_mean"] == 0.0 and s["action_bigram_jaccard_mean"] == 0.0
    assert d_K([[], ["a"]]) == 1.0


def test_values_in_unit_interval():
    import random

    rng = random.Random(0)
    for _ in range(200):
        g = rng.randint(2, 8)
        acts = [[rng.choice("abcd") for _ in range(rng.randint(0, 6))] for _ in range(g)]
        s = compute_signals(acts, [rng.choice("xy") for _ in range(g)], [rng.random() < 0.3 for _ in range(g)])
        assert all(0.0 <= v <= 1.0 + 1e-12 for v in s.values())


def test_invalid_actions_and_reply_nll_pooled_over_the_group():
    """Issue 49's two signals: the share of invalid actions over every step of the G prefixes, and
    the replies' negative log-prob per generated token, both pooled (a longer prefix weighs more)."""
    acts = [["go to desk 1", "invalid:fly"], ["invalid:x", "invalid:y", "look"], []]
    replies = [[(-1.0, 2), (-3.0, 4)], [(-0.5, 1), (0.0, 3), (-0.5, 2)], []]
    s = compute_signals(acts, ["o", "o", "o"], [False, False, True], replies)
    assert s["invalid_action_fraction"] == pytest.approx(3 / 5)
    assert s["reply_nll_mean"] == pytest.approx(5.0 / 12)
    assert compute_signals(acts, ["o"] * 3, [False] * 3)["reply_nll_mean"] == 0.0  # no replies recorded: 0
    # a gate reads many invalid actions as converged (to failing), like a high termination_fraction
    assert convergence_score("invalid_action_fraction", s) == pytest.approx(0.4)
    assert convergence_score("reply_nll_mean", s) == s["reply_nll_mean"]
    with pytest.raises(ValueError):
        compute_signals(acts, ["o"] * 3, [False] * 3, replies[:2])


def test_reply_logprobs_one_entry_per_reply():
    mask = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    lps = [0.0, 0.0, -0.5, -0.25, 0.0, -2.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    assert reply_logprobs(lps, mask, [2, 5, 8]) == [(-0.75, 2), (-2.0, 1), (-2.0, 3)]
    assert reply_logprobs([], [], []) == [] and reply_logprobs([0.0], [0], []) == []
    # signals_at takes the first K replies with the first K actions
    t = Trace(["a", "invalid:b", "c"], ["o1", "o2", "o3"], "o0", None, reply_logprobs(lps, mask, [2, 5, 8]))
    s = signals_at([t, t], 2)
    assert s["invalid_action_fraction"] == 0.5 and s["reply_nll_mean"] == pytest.approx(2.75 / 3)


def test_gate_fires_strictly_below_d_L():
    gate = Threshold(10, 0.25)
    base = {"termination_fraction": 0.0}
    assert gate.fires(base | {"prefix_edit_distance_mean": 0.2499})
    assert not gate.fires(base | {"prefix_edit_distance_mean": 0.25})  # exactly d_L: no cut
    assert not gate.fires(base | {"prefix_edit_distance_mean": 0.9})


def test_or_rule():
    gate = Threshold(10, 0.12, tau_H=0.9)
    assert gate.fires({"prefix_edit_distance_mean": 0.5, "termination_fraction": 0.9})
    assert not gate.fires({"prefix_edit_distance_mean": 0.5, "termination_fraction": 0.875})


@pytest.mark.parametrize("spec", ["10", "a,b", "10,0.1,3", "-1,0.1", "10;0.1"])
def test_malformed_gate(spec):
    with pytest.raises(UserError, match="malformed gate"):
        parse_gate(spec)


@pytest.mark.parametrize("spec, message", [("0,0.1", "K must be >= 1"), ("10,1.5", r"d_L must be in \[0, 1\]")])
def test_gate_out_of_range(spec, message):
    with pytest.raises(UserError, match=message):
        parse_gate(spec)


def test_parse_gate():
    assert parse_gate("10,0.12") == GateSpec(10, 0.12)
    assert parse_gate(" 5 , .3 ", tau_H=0.9) == GateSpec(5, 0.3, 0.9)
    assert parse_gate("off") is None and parse_gate(None) is None
    with pytest.raises(UserError, match="needs a gate"):
        parse_gate("off", tau_H=0.9)
    with pytest.raises(UserError, match="tau_H"):
        parse_gate("10,0.1", tau_H=2.0)
    assert parse_gate("5,auto:invalid").signal == "invalid_action_fraction"
    assert parse_gate("5,auto:d+invalid+nll").signals == ("prefix_edit_distance_mean", "invalid_action_fraction",
                                                          "reply_nll_mean")


# ---------------------------------------------------------------- one definition for every tier
class _EngineDiesAt:
    """A real ALFWorld env whose engine fails on its `fail_at`-th step (None: never)."""

    def __init__(self, game, fail_at):
        self.env, self.fail_at, self.steps = AlfworldEnv(game), fail_at, 0

    def reset(self):
        return self.env.reset()

    def step(self, command):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("the engine died")
        return self.env.step(command)

    def close(self):
        self.env.close()


class _Mixed:
    """Trajectories 0 and 1 play the game's walkthrough (0 wins; 1's engine dies at step 3), 2 wanders.
    Stand-in token ids, so the records are a buffer Tier 2 loads."""

    def start(self, traj):
        traj.append([1, 2, 3], generated=False)

    def act(self, trajs):
        out = []
        for t in trajs:
            w, n = t.game.walkthrough, len(t.steps)
            t.append([4, 5], generated=True, logprobs=[-0.5 * t.index, -0.1 * n])  # reply_nll_mean differs by K
            gotos = sorted(c for c in t.admissible if c.startswith("go to ")) or ["look"]
            wander = "fly to the moon" if n % 3 == 1 else gotos[n % len(gotos)]  # an invalid action now and then
            out.append(f"Action: {w[n] if t.index < 2 and n < len(w) else wander}")
        return out

    def observe(self, traj, obs): ...

    def finish(self, trajs): ...


def test_tier_2_reads_a_rollouts_buffer_with_the_signals_the_rollout_computed(tmp_path, games):
    """Tiers 1 and 3 compute the signals live, right after step K; Tier 2 computes them later from
    the trajectories.jsonl records of the finished rollout. Same definition, same values, at every
    K: also for a trajectory that won at K, one whose env failed after K (finished later, so not by
    K) and ones that ended before K."""
    made = []

    def make_env(game):
        made.append(game)
        return _EngineDiesAt(game, 3 if len(made) % 3 == 2 else None)  # trajectory 1 of each group

    steps = tuple(range(1, 8))
    rollout = run_lockstep([games["pick_and_place_simple"], games["look_at_obj_in_light"]], _Mixed(), max_steps=7,
                           group_size=3, signal_steps=steps, make_env=make_env)
    trajs = {(g.game.task_type, t.index): t for g in rollout.groups for t in g.trajectories}
    assert trajs["look_at_obj_in_light", 0].stop_reason == "won" and len(trajs["look_at_obj_in_light", 0].steps) == 3
    assert all(trajs[k, 1].stop_reason == "env_error" and len(trajs[k, 1].steps) == 2 for k in ("pick_and_place_simple", "look_at_obj_in_light"))
    assert trajs["pick_and_place_simple", 2].stop_reason == "max_steps"
    # at K = 2 the failed trajectory was still running (its engine died on step 3)
    assert rollout.groups[0].signals[2]["termination_fraction"] == 0.0
    assert rollout.groups[0].signals[2]["invalid_action_fraction"] == pytest.approx(1 / 6)  # the wanderer's step 2
    assert rollout.groups[0].signals[2]["reply_nll_mean"] > 0

    write_rollout(rollout, tmp_path, steps)
    (tmp_path / "groups.csv").unlink()  # Tier 2 computes every signal from the step records
    buffer = load_buffer(tmp_path / "trajectories.jsonl")
    assert [b.task_id for b in buffer] == [g.game.game_id for g in rollout.groups]
    for live, recorded in zip(rollout.groups, buffer):
        assert sorted(live.signals) == list(steps)
        for K in steps:
            assert recorded.signals_at(K) == live.signals[K], (live.game.task_type, K)


def test_finished_by_K_reads_alike_live_and_recorded():
    def trace(n, why):
        return Trace([f"a{i}" for i in range(n)], [f"o{i}" for i in range(n)], "o", why)

    assert not trace(2, None).finished_by(2)  # running
    assert trace(2, "won").finished_by(2) and trace(2, "lost").finished_by(3) and trace(2, "max_steps").finished_by(2)
    # stopped after step 2 without a step 3: its env failed or its context filled on the way to step 3
    assert not trace(2, "env_error").finished_by(2) and trace(2, "env_error").finished_by(3)
    assert not trace(2, "context_full").finished_by(2) and trace(2, "context_full").finished_by(3)
    assert trace(0, "env_error").finished_by(1)  # the game never loaded
    assert not trace(2, "won").finished_by(1)  # later steps: not yet
    assert not trace(2, "gate_cut").finished_by(5)  # the gate's doing, not the trajectory's
    s = signals_at([trace(2, "won"), trace(3, None)], 2)
    assert s["termination_fraction"] == 0.5 and s["obs_unique_ratio"] == 0.5  # both saw o1 after step 2
    s = signals_at([trace(2, "won"), trace(3, None)], 3)
    assert s["termination_fraction"] == 0.5 and s["obs_unique_ratio"] == 1.0  # o1 (the winner's last) and o2
