"""Pilot-Commit stage: bins, eviction (persistent, through state), at most B committed, stats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.rollout.lockstep import Group
from agentrl.rollout.trajectory import Trajectory
from agentrl.select.base import Stage
from agentrl.select.pilot_commit import Decision, PilotCommit


def game(i: int) -> Game:
    return Game(game_id=f"task-{i}/trial", split="train", task_type="pick_and_place_simple", path=Path("/none"))


def group(i: int, wins: int, n: int = 8, cut: bool = False, tokens: int = 10) -> Group:
    """A pilot group of n trajectories, the first `wins` won."""
    g = game(i)
    trajs = [Trajectory(game=g, index=k, stop_reason="won" if k < wins else "lost", step_tokens=[tokens])
             for k in range(n)]
    return Group(game=g, trajectories=trajs, cut=cut)


def ids(games: list[Game]) -> list[str]:
    return [g.game_id for g in games]


def test_is_a_stage():
    s = PilotCommit()
    assert isinstance(s, Stage) and s.name == "pilot-commit" and s.point == "before"


def test_bins_pass_into_the_buffer_and_drop_the_rest():
    """T 312-319: low <= s <= high passes (into the buffer, R 64); too correct and too incorrect
    are dropped for now, not deferred; eviction only where evict_at is set (T 338-350)."""
    s = PilotCommit(n_p=8, group_size=16)
    s.begin(1)
    # success 0.0, 0.125, 0.75, 0.875 (> 0.75), 1.0, and a cut group
    groups = [group(0, 0), group(1, 1), group(2, 6), group(3, 7), group(4, 8), group(5, 4, cut=True)]
    d = s.decide(groups)
    assert isinstance(d, Decision)
    assert ids(d.passed) == ids([game(1), game(2)]) and sorted(s.buffer) == ids([game(1), game(2)])
    assert ids(d.dropped) == ids([game(0), game(3), game(4), game(5)])
    assert d.evicted == [] and not s.evicted  # the authors' code default: no eviction
    e = PilotCommit(n_p=8, group_size=16, evict_at=1.0)  # the authors' scripts
    e.begin(1)
    assert ids(e.decide(groups).evicted) == ids([game(4)]) and e.is_evicted(game(4).game_id)


def test_passed_pilots_wait_in_the_buffer_sampled_by_pilot_std_then_recency_and_age_out():
    s = PilotCommit(n_p=8)
    s.begin(1)
    s.decide([group(0, 1), group(1, 4), group(2, 3)])  # std: 0.33, 0.5, 0.48
    s.begin(2)
    s.decide([group(3, 4)])  # std 0.5, newer than task 1
    taken = s.take(2)
    assert ids([e.game for e in taken]) == ids([game(3), game(1)])  # R 256-257: std, then the newest
    assert sorted(s.buffer) == ids([game(0), game(2)])  # taken ones leave the buffer
    s.begin(5)
    s.flush()  # age 4 stays (R 83-85: dropped only when older than max_age)
    assert sorted(s.buffer) == ids([game(0), game(2)])
    s.begin(6)
    s.flush()
    assert s.buffer == {}
    r = PilotCommit(n_p=8, sampling="random", seed=3)
    r.begin(1)
    r.decide([group(i, 4) for i in range(6)])
    assert len(r.take(2)) == 2 and len(r.buffer) == 4
    assert len(r.take(10)) == 4 and r.buffer == {}  # fewer than asked: all of them (R 130-135)


def test_eviction_persists_across_iterations_and_state():
    s = PilotCommit(n_p=2, pilot_factor=1, evict_at=1.0)
    s.begin(1)
    s.decide([group(0, 2, n=2), group(1, 1, n=2), group(2, 2, n=2)])
    assert s.pilot_tasks([game(i) for i in range(5)], B=3) == [game(3), game(4)]  # 0, 2 evicted; 1 in the buffer
    assert s.is_evicted(game(0).game_id) and s.is_evicted(game(2).game_id)
    t = PilotCommit(n_p=2, pilot_factor=1)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))  # what a checkpoint holds
    assert t.evicted == {game(0).game_id, game(2).game_id}
    (entry,) = t.buffer.values()  # task 1 waits for its commit, pilot trajectories and all
    assert entry.game == game(1) and entry.pilot.rewards == [1.0, 0.0] and entry.iteration == 1
    assert t.state_dict() == s.state_dict()
    assert t.pilot_tasks([game(i) for i in range(5)], B=2) == [game(3), game(4)]


def test_pilot_tasks_takes_pilot_factor_times_B():
    s = PilotCommit()
    stream = [game(i) for i in range(10)] + [game(0)]
    assert s.pilot_tasks(stream, B=2) == [game(i) for i in range(6)]
    assert len(s.pilot_tasks(stream[:4], B=2)) == 4  # the stream runs out


def test_stats():
    s = PilotCommit(n_p=2, group_size=8)
    s.begin(1)
    # 3 pilot groups of 2 trajectories: tokens 2x10, 2x20, 2x30 -> 120 in all, 20 per trajectory
    d = s.decide([group(0, 1, n=2, tokens=10), group(1, 0, n=2, tokens=20), group(2, 2, n=2, tokens=30)])
    assert ids(d.passed) == [game(0).game_id]
    s.account(committed=1, pilot_tokens_out_of_loss=100, rounds=2, pilot_traj_tokens=20.0)
    st = s.stats()
    assert st.decisions == {"tasks_piloted": 3, "tasks_passed": 1, "tasks_committed": 1, "tasks_dropped": 2,
                            "tasks_evicted": 0, "rounds": 2}
    assert st.step_tokens_generated == 120 and st.step_tokens_excluded == 100
    assert st.step_tokens_avoided == (8 - 2) * 20 * 2
    s.observe([])  # no-op
    s.begin(2)  # a new iteration resets the accounting
    assert set(s.stats().decisions.values()) == {0} and s.stats().step_tokens_generated == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"low": 0.5, "high": 0.5}, "pilot-commit: need 0 <= low < high <= 1, got low=0.5 high=0.5"),
    ({"low": -0.1}, "low"),
    ({"high": 1.5}, "high"),
    ({"pilot_factor": 0.5}, "pilot-commit: pilot_factor must be >= 1, got 0.5"),
    ({"n_p": 0}, "n_p"),
    ({"n_p": 4, "group_size": 4}, "n_p must be < the group size G=4"),
    ({"evict_at": 0}, "evict_at"),
    ({"max_rounds": 0}, "max_rounds"),
    ({"sampling": "best"}, "sampling must be one of max_variance, random"),
])
def test_invalid_parameters(kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PilotCommit(**kwargs)


# ------------------------------------------------------------------ the rounds, through Selection


class Pool:
    """A training pool whose task i wins with its own scripted pilot/commit outcomes."""

    def __init__(self, n: int):
        self.pool = [game(i) for i in range(n)]

    def stream(self):
        return list(self.pool)

    def select(self, n):
        return self.pool[:n]


def scripted_roll(wins_of, calls):
    """roll(games, G, first_index, stages): trajectory k of task i wins iff wins_of(i, first_index + k)."""
    from agentrl.rollout.lockstep import Rollout, RolloutStats

    def roll(games, G, first, stages):
        calls.append((len(games), G, first))
        groups = []
        for g in games:
            i = int(g.game_id.split("-")[1].split("/")[0])
            trajs = [Trajectory(game=g, index=first + k, stop_reason="won" if wins_of(i, first + k) else "lost",
                                step_tokens=[10]) for k in range(G)]
            groups.append(Group(game=g, trajectories=trajs))
        return Rollout(groups, RolloutStats(step_tokens=10 * G * len(games)))
    return roll


def test_rounds_fill_the_batch_from_the_buffer():
    """Only one task in eight passes its pilot: the old rule trained on what one pilot round
    passed (1 task here); the authors run up to ten rounds and commit from the buffer until B."""
    from agentrl.config import load_config
    from agentrl.select.selection import Selection

    cfg = load_config(None, {"select.stages": "pilot-commit", "rollout.gate": "off", "rollout.tasks": 4,
                             "rollout.group_size": 8})
    sel = Selection(cfg)
    pc = sel.by_name["pilot-commit"]
    assert pc.n_p == 2  # G / 4
    calls: list = []
    roll = scripted_roll(lambda i, k: (i % 8 == 0 and k % 2 == 0) or i % 8 == 1, calls)  # 8k: half win; 8k+1 all
    sel.begin(1)
    rollout = sel.rollout(Pool(400), B=4, G=8, roll=roll)
    trained = [g for g in rollout.groups if not g.excluded_by]
    assert len(trained) == 4 and all(len(g.trajectories) == 8 for g in trained)  # pilot 2 + commit 6 each
    assert all([t.index for t in g.trajectories] == list(range(8)) for g in trained)
    st = pc.stats().decisions
    assert st["tasks_committed"] == 4 and 2 <= st["rounds"] <= 10
    assert calls[0] == (12, 2, 0) and (len(calls) - 1) // 2 + 1 == st["rounds"]  # round 1 pilots only, then commit + pilot
    assert rollout.stats.step_tokens == sum(10 * n * G for n, G, _ in calls)


def test_a_short_batch_after_max_rounds_trains_on_what_it_has():
    from agentrl.config import load_config
    from agentrl.select.selection import Selection

    cfg = load_config(None, {"select.stages": "pilot-commit", "rollout.gate": "off", "rollout.tasks": 4,
                             "rollout.group_size": 8, "select.pilot_commit.max_rounds": 2})
    sel = Selection(cfg)
    sel.begin(1)
    rollout = sel.rollout(Pool(400), B=4, G=8, roll=scripted_roll(lambda i, k: i % 24 == 0 and k % 2 == 0, []))
    trained = [g for g in rollout.groups if not g.excluded_by]
    assert len(trained) == 1 and sel.by_name["pilot-commit"].stats().decisions["rounds"] == 2


def test_buffered_pilots_carry_into_the_next_iteration_and_are_counted_once():
    from agentrl.config import load_config
    from agentrl.select.selection import Selection

    cfg = load_config(None, {"select.stages": "pilot-commit", "rollout.gate": "off", "rollout.tasks": 1,
                             "rollout.group_size": 8})
    sel = Selection(cfg)
    calls: list = []
    roll = scripted_roll(lambda i, k: k % 2 == 0, calls)  # every task passes its pilot
    sel.begin(1)
    first = sel.rollout(Pool(40), B=1, G=8, roll=roll)
    pc = sel.by_name["pilot-commit"]
    assert len([g for g in first.groups if not g.excluded_by]) == 1 and len(pc.buffer) == 5  # 3 + 3 piloted, 1 taken
    sel.begin(2)
    calls.clear()
    second = sel.rollout(Pool(40), B=1, G=8, roll=roll)
    (merged,) = [g for g in second.groups if not g.excluded_by]
    assert merged.carried_step_tokens == 2 * 10  # its pilot was generated (and counted) in iteration 1
    m = sel.metrics(second.groups, [])
    assert m["step_tokens_generated"] == sum(10 * n * G for n, G, _ in calls) and m["step_tokens_carried"] == 20


def test_a_task_committed_this_iteration_is_not_piloted_again_in_it():
    """The issue's example (checked against databricks/pilot-commit 6def20e, T 692: train_bsz distinct
    prompts per batch): n_pilot 2, G 8, B 2, pilot_factor 1, buffer {X}, candidates [X, Y, Z].
    Round 1 commits X and pilots [Y, Z], not [X, Y]; the batch never holds X twice."""
    from agentrl.config import load_config
    from agentrl.select.pilot_commit import Entry
    from agentrl.select.selection import Selection

    cfg = load_config(None, {"select.stages": "pilot-commit", "rollout.gate": "off", "rollout.tasks": 2,
                             "rollout.group_size": 8, "select.pilot_commit.pilot_factor": 1})
    sel = Selection(cfg)
    pc = sel.by_name["pilot-commit"]
    X = game(0)
    pc.buffer[X.game_id] = Entry(X, group(0, wins=1, n=2), iteration=0, std=0.5)
    calls: list = []
    piloted: list = []
    roll = scripted_roll(lambda i, k: k % 2 == 0, calls)  # every pilot wins 1 of 2: passes

    def spy(games, G, first, stages):
        if G == pc.n_p:
            piloted.append(ids(games))
        return roll(games, G, first, stages)

    sel.begin(1)
    rollout = sel.rollout(Pool(3), B=2, G=8, roll=spy)
    assert piloted[0] == ["task-1/trial", "task-2/trial"]  # [Y, Z]
    batch = [g.game.game_id for g in rollout.groups if not g.excluded_by]
    assert len(batch) == 2 and len(set(batch)) == 2 and batch[0] == X.game_id


def test_pilot_tasks_reads_no_candidate_past_its_last_pilot():
    """The issue's second defect: a round took the next item from the stream, then stopped, and that
    task was lost to the iteration; now consecutive rounds see consecutive candidates."""
    s = PilotCommit(pilot_factor=1)
    stream = iter([game(i) for i in range(5)])
    assert s.pilot_tasks(stream, B=2) == [game(0), game(1)]
    assert s.pilot_tasks(stream, B=2) == [game(2), game(3)]  # game 2 was dropped before
    assert s.pilot_tasks(stream, B=2) == [game(4)]


def test_an_iteration_that_commits_nothing_is_explained_once():
    from agentrl.config import load_config
    from agentrl.select.selection import Selection

    cfg = load_config(None, {"select.stages": "pilot-commit", "rollout.gate": "off", "rollout.tasks": 2,
                             "rollout.group_size": 8, "select.pilot_commit.max_rounds": 3})
    warnings: list[str] = []
    sel = Selection(cfg, warn=warnings.append)
    never = scripted_roll(lambda i, k: False, [])  # the base model: no pilot ever wins
    for it in (1, 2):
        sel.begin(it)
        sel.rollout(Pool(100), B=2, G=8, roll=never)
    assert len(warnings) == 1
    assert "committed no task: 0 of 18 piloted tasks passed" in warnings[0] and "in 3 round(s)" in warnings[0]
    assert "warm-started" in warnings[0]
