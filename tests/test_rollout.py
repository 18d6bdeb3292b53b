"""Group rollouts + gate on real games, driven by scripted policies (no model needed)."""

from agentrl.rollout import run_lockstep
from agentrl.rollout.lockstep import action_symbol
from agentrl.select.cut import CutStage  # the gate is a step stage the caller passes
from agentrl.select.dapo import DapoFilter
from agentrl.select.gate_rule import Threshold


class Scripted:
    """Trajectory i of every group plays script(game, i)[step]; records each batched call."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def start(self, traj): ...

    def act(self, trajs):
        self.calls.append([(t.game.game_id, t.index) for t in trajs])
        return [f"Thought: scripted\nAction: {self.script(t, len(t.steps))}" for t in trajs]

    def observe(self, traj, obs): ...

    def finish(self, trajs): ...


def look_everyone(traj, step):
    return "look"


def wander(traj, step):
    """Each trajectory index visits a different receptacle sequence: prefixes diverge."""
    gotos = sorted(c for c in traj.admissible if c.startswith("go to ")) or ["look"]
    return gotos[(traj.index * 3 + step) % len(gotos)]


def test_converged_group_is_cut_at_K(games):
    policy = Scripted(look_everyone)
    rollout = run_lockstep([games["pick_and_place_simple"]], policy, max_steps=6, group_size=4,
                           stages=[CutStage(Threshold(2, 0.12))], signal_steps=(1, 2, 4))
    (group,) = rollout.groups
    assert group.cut and group.cut_step == 2
    assert group.signals[2]["prefix_edit_distance_mean"] == 0.0
    assert 4 not in group.signals  # no signals after the cut
    assert all(t.stop_reason == "gate_cut" and len(t.steps) == 2 for t in group.trajectories)
    assert len(policy.calls) == 2


def test_only_converged_groups_are_cut_and_groups_share_each_generate_call(games):
    def script(traj, step):
        return "look" if traj.game.task_type == "pick_and_place_simple" else wander(traj, step)

    policy = Scripted(script)
    rollout = run_lockstep([games["pick_and_place_simple"], games["pick_two_obj_and_place"]], policy,
                           max_steps=5, group_size=3, stages=[CutStage(Threshold(2, 0.12))], signal_steps=(2, 5))
    converged, diverse = rollout.groups
    assert converged.cut and not diverse.cut
    assert diverse.signals[2]["prefix_edit_distance_mean"] > 0.12 and 5 in diverse.signals
    assert all(t.stop_reason == "max_steps" and len(t.steps) == 5 for t in diverse.trajectories)
    # lockstep: steps 1-2 batch all 6 trajectories of both groups in one call; then only the survivors
    assert [len(c) for c in policy.calls] == [6, 6, 3, 3, 3]
    assert rollout.stats.env_steps == 3 * 2 + 3 * 5
    assert converged.env_steps == 6 and diverse.env_steps == 15


def test_gate_off_never_cuts_and_same_seed_prefixes_match(games):
    game = games["pick_and_place_simple"]
    base = run_lockstep([game], Scripted(look_everyone), max_steps=4, group_size=3, signal_steps=(2,))
    gated = run_lockstep([game], Scripted(look_everyone), max_steps=4, group_size=3, stages=[CutStage(Threshold(2, 0.5))])
    assert not base.groups[0].cut and gated.groups[0].cut
    for a, b in zip(base.trajectories, gated.trajectories):
        assert [action_symbol(s) for s in a.steps[:2]] == [action_symbol(s) for s in b.steps[:2]]
        assert [s.observation for s in a.steps[:2]] == [s.observation for s in b.steps[:2]]


def test_trajectories_that_won_before_K_count_as_finished(games):
    won_early = games["look_at_obj_in_light"]  # walkthrough: 3 steps
    running = games["pick_two_obj_and_place"]

    def script(traj, step):
        w = traj.game.walkthrough
        return w[step] if traj.game is won_early else "look"

    rollout = run_lockstep([won_early, running], Scripted(script), max_steps=8, group_size=3,
                           stages=[CutStage(Threshold(5, 0.12))], signal_steps=(5,))
    done, live = rollout.groups
    assert done.signals[5]["termination_fraction"] == 1.0 and done.signals[5]["prefix_edit_distance_mean"] == 0.0
    assert not done.cut  # finished before K: nothing to save, the gate leaves it (and its wins) alone
    assert all(t.stop_reason == "won" for t in done.trajectories) and done.zero_variance
    assert live.cut and live.signals[5]["termination_fraction"] == 0.0


def test_cut_groups_never_reach_the_advantage(games):
    from agentrl.train.advantage import batch_advantages

    def script(traj, step):
        return "look" if traj.game.task_type == "pick_and_place_simple" else wander(traj, step)

    rollout = run_lockstep([games["pick_and_place_simple"], games["pick_two_obj_and_place"]], Scripted(script),
                           max_steps=3, group_size=2, stages=[CutStage(Threshold(2, 0.12))])
    converged, diverse = rollout.groups
    assert converged.cut and not diverse.cut
    batch = batch_advantages(rollout.groups)
    assert {id(t) for t, _ in batch} == {id(t) for t in diverse.trajectories}
    assert batch_advantages(DapoFilter().keep(rollout.groups)) == []  # the survivor is all-fail: zero variance


def test_group_advantages_eq1():
    import numpy as np
    import pytest

    from agentrl.train.advantage import group_advantages

    r = [1, 0, 0, 1, 1, 0, 0, 0]
    a = group_advantages(r)
    assert a.mean() == pytest.approx(0) and a.std() == pytest.approx(1, abs=1e-5)
    assert np.all(group_advantages([1, 1, 1]) == 0)
    assert group_advantages([1, 0, 0], "rloo").tolist() == [1.0, -0.5, -0.5]
    assert group_advantages([1, 0], "dr_grpo").tolist() == [0.5, -0.5]
    # raft: no baseline; a win is 1 wherever it is, so an all-success group is not zero-signal
    assert group_advantages([1, 0, 0, 1], "raft").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert group_advantages([1, 1, 1], "raft").tolist() == [1.0, 1.0, 1.0]
    assert group_advantages([0, 0, 0], "raft").tolist() == [0.0, 0.0, 0.0]


def test_an_episode_at_the_samplers_context_ends_cleanly(games, tiny_model, tokenizer):
    """vLLM ends a request early at max_model_len (the hf backend would go on): the rollout ends
    such an episode before it, as `context_full`, so no reply is ever cut by the context."""
    from agentrl.rollout import ModelPolicy
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.hf import HFSampler

    sampler = HFSampler(tiny_model, tokenizer)
    assert sampler.max_model_len == tiny_model.config.max_position_embeddings  # the model's own limit by default
    params = SamplingParams(1.0, 1.0, 8)
    game = games["pick_and_place_simple"]
    probe = run_lockstep([game], ModelPolicy(sampler, params, seed=1), max_steps=1, fuzzy_threshold=0, group_size=1)
    first = len(probe.trajectories[0].token_ids)
    sampler.max_model_len = first + 60 + params.max_new_tokens  # room for the first prompt and about one more turn
    seen: list[int] = []
    inner = sampler.generate
    sampler.generate = lambda requests, *a, **k: (seen.extend(len(r.prompt_ids) for r in requests), inner(requests, *a, **k))[1]
    rollout = run_lockstep([game], ModelPolicy(sampler, params, seed=1), max_steps=20, fuzzy_threshold=0, group_size=2)
    for t in rollout.trajectories:
        assert t.stop_reason == "context_full" and 1 <= len(t.steps) < 20
    assert max(seen) + params.max_new_tokens <= sampler.max_model_len


def test_an_episode_whose_first_take_is_another_object_is_counted(games):
    """`took_another_object`: the first `take` of a real game's episode against the task's object
    (its task directory's): the walkthrough's own is the object; one that takes something else
    first counts, whatever it takes later; an episode that takes nothing, or a game with no task
    directory, is left out of the rate."""
    from agentrl.env.data import Game, task_object
    from agentrl.rollout.trajectory import Step, Trajectory, behaviour_metrics, took_another_object

    game = games["pick_and_place_simple"]
    obj = task_object(game)
    assert obj and obj == game.game_id.split("-")[1].lower()

    def played(commands, g=game):
        return Trajectory(g, steps=[Step(f"Action: {c}", c, c, "", False, False) for c in commands], stop_reason="max_steps")

    walk = played(game.walkthrough)
    other = played(["go to shelf 1", "take zzz 1 from shelf 1", f"take {obj} 1 from shelf 1"])
    nothing = played(["go to shelf 1", "look"])
    synthetic = played(["take zzz 1 from shelf 1"], Game("synthetic/0", "train", game.task_type, game.path))
    assert took_another_object(walk) is False and took_another_object(other) is True
    assert took_another_object(nothing) is None and took_another_object(synthetic) is None
    assert behaviour_metrics([walk, other, nothing, synthetic])["other_object_rate"] == 0.5
    assert behaviour_metrics([nothing])["other_object_rate"] is None
    from agentrl.cli.display import behaviour

    assert "other object 50%" in behaviour(behaviour_metrics([walk, other]))


def test_an_episode_that_runs_out_of_steps_in_a_cycle_is_counted_as_looped(games, tokenizer):
    """`looped`: the last 12 commands repeat a cycle of at most 6 (the greedy policy's commonest
    failure). A real game played by given replies (sft's ExpertSampler): going back and forth
    between two places until T_max is a loop; the same replies cut short by T_max 11 are not
    (fewer than 12 steps), nor is an episode whose last 12 commands hold no cycle; a won episode
    never is. Counted per trajectory in the behaviour metrics and the console line."""
    from agentrl.rollout import ModelPolicy
    from agentrl.rollout.trajectory import Step, Trajectory, behaviour_metrics, looped
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    game = games["pick_and_place_simple"]
    places = [c for c in game.walkthrough if c.startswith("go to ")][:2]
    assert len(set(places)) == 2
    replies = tuple(f"Action: {places[i % 2]}" for i in range(14))
    sampler = ExpertSampler(tokenizer, {game.game_id: replies}, None)
    for max_steps, want in ((14, True), (11, False)):
        rollout = run_lockstep([game], ModelPolicy(sampler, SamplingParams(0.0, 1.0, 16), seed=0), max_steps=max_steps)
        t = rollout.trajectories[0]
        assert t.stop_reason == "max_steps" and len(t.steps) == max_steps and looped(t) is want
    assert behaviour_metrics([t, t])["looped_rate"] == 0.0

    def played(commands, stop="max_steps"):
        steps = [Step(f"Action: {c}", c, c, "", False, False) for c in commands]
        return Trajectory(game, steps=steps, stop_reason=stop)

    cycle6 = [f"go to shelf {i}" for i in range(6)] * 3
    assert looped(played(cycle6)) and not looped(played(cycle6, stop="won"))
    assert not looped(played([f"go to shelf {i}" for i in range(7)] * 3))  # a cycle of 7: not counted
    assert not looped(played(["look"] * 11 + ["inventory"]))
    metrics = behaviour_metrics([played(cycle6), played(["look"] * 20, stop="won")])
    assert metrics["looped_rate"] == 0.5
    from agentrl.cli.display import behaviour

    assert "looped 50%" in behaviour(metrics)


def test_replies_cut_at_max_new_tokens_are_counted(games, tokenizer):
    """A reply that runs into max_new_tokens (no end-of-turn) is counted per trajectory and in the
    behaviour metrics (the console's "% cut at max_new_tokens"): a policy drifting into junk, such
    as runs of digits, shows there before success falls. The replies are given verbatim (sft's
    ExpertSampler), the over-long one cut by the policy as any sampler's."""
    from agentrl.rollout import ModelPolicy
    from agentrl.rollout.trajectory import behaviour_metrics
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    game = games["pick_and_place_simple"]
    replies = ("Action: look", "Action: go to shelf 100000000000000000000000000000", "Action: inventory")
    sampler = ExpertSampler(tokenizer, {game.game_id: replies}, None)
    rollout = run_lockstep([game], ModelPolicy(sampler, SamplingParams(0.0, 1.0, 12), seed=0), max_steps=3)
    t = rollout.trajectories[0]
    assert t.step_tokens[1] == 12 and t.cut_steps == [1] and t.replies_cut == 1 and t.step_tokens[0] < 12 and t.step_tokens[2] < 12
    metrics = behaviour_metrics([t])
    assert metrics["replies_cut_rate"] == round(1 / 3, 4)
    from agentrl.cli.display import behaviour  # the console line: shown when not 0

    assert "(33% cut at max_new_tokens)" in behaviour(metrics) and "cut" not in behaviour({**metrics, "replies_cut_rate": 0.0})
