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


def test_bins():
    s = PilotCommit(n_p=8, group_size=16)
    s.pilot_tasks([game(i) for i in range(6)], B=2)
    # success 0.0, 0.125, 0.75, 0.875 (> 0.75), 1.0, and a cut group
    groups = [group(0, 0), group(1, 1), group(2, 6), group(3, 7), group(4, 8), group(5, 4, cut=True)]
    assert groups[1].rewards.count(1.0) == 1 and groups[4].zero_variance
    d = s.decide(groups)
    assert isinstance(d, Decision)
    assert ids(d.commit) == ids([game(1), game(2)])
    assert ids(d.deferred) == ids([game(0), game(5)])
    assert ids(d.skipped) == ids([game(3), game(4)])
    assert ids(d.evicted) == ids([game(4)])
    assert s.is_evicted(game(4).game_id) and not s.is_evicted(game(3).game_id)


def test_at_most_B_committed_closest_to_half():
    s = PilotCommit(n_p=8)
    s.pilot_tasks([game(i) for i in range(6)], B=2)
    # success 0.125, 0.75, 0.5, 0.375, 0.625, 0.375: 0.5 first, then the 0.375/0.625 ties by order -> game 3
    d = s.decide([group(0, 1), group(1, 6), group(2, 4), group(3, 3), group(4, 5), group(5, 3)])
    assert ids(d.commit) == ids([game(2), game(3)])  # in pilot order
    assert ids(d.skipped) == ids([game(0), game(1), game(4), game(5)])
    assert d.deferred == [] and d.evicted == []


def test_eviction_persists_across_iterations_and_state():
    s = PilotCommit(n_p=2, pilot_factor=1)
    s.pilot_tasks([game(i) for i in range(3)], B=3)
    s.decide([group(0, 2, n=2), group(1, 1, n=2), group(2, 2, n=2)])
    assert s.pilot_tasks([game(i) for i in range(5)], B=3) == [game(1), game(3), game(4)]
    s.decide([group(1, 1, n=2), group(3, 0, n=2), group(4, 1, n=2)])  # nothing new evicted
    assert s.is_evicted(game(0).game_id) and s.is_evicted(game(2).game_id)
    t = PilotCommit(n_p=2, pilot_factor=1)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.state_dict() == {"evicted": [game(0).game_id, game(2).game_id]}
    assert t.pilot_tasks([game(i) for i in range(5)], B=2) == [game(1), game(3)]


def test_pilot_tasks_takes_pilot_factor_times_B():
    s = PilotCommit()
    stream = [game(i) for i in range(10)] + [game(0)]
    assert s.pilot_tasks(stream, B=2) == [game(i) for i in range(6)]
    assert len(s.pilot_tasks(stream[:4], B=2)) == 4  # the stream runs out


def test_stats():
    s = PilotCommit(n_p=2, group_size=8)
    s.pilot_tasks([game(i) for i in range(3)], B=1)
    # 3 pilot groups of 2 trajectories: tokens 2x10, 2x20, 2x30 -> 120 in all, 20 per trajectory
    d = s.decide([group(0, 1, n=2, tokens=10), group(1, 0, n=2, tokens=20), group(2, 2, n=2, tokens=30)])
    assert ids(d.commit) == [game(0).game_id]
    st = s.stats()
    assert st.decisions == {"tasks_piloted": 3, "tasks_committed": 1, "tasks_deferred": 1,
                            "tasks_skipped": 1, "tasks_evicted": 1}
    assert st.step_tokens_generated == 120
    assert st.step_tokens_excluded == 40 + 60
    assert st.step_tokens_avoided == (8 - 2) * 20 * 2
    s.observe([])  # no-op
    s.pilot_tasks([game(5)], B=1)  # a new iteration resets the accounting
    assert s.stats().decisions == {} and s.stats().step_tokens_generated == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"low": 0.5, "high": 0.5}, "pilot-commit: need 0 <= low < high <= 1, got low=0.5 high=0.5"),
    ({"low": -0.1}, "low"),
    ({"high": 1.5}, "high"),
    ({"pilot_factor": 0.5}, "pilot-commit: pilot_factor must be >= 1, got 0.5"),
    ({"n_p": 0}, "n_p"),
    ({"n_p": 4, "group_size": 4}, "n_p must be < the group size G=4"),
])
def test_invalid_parameters(kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PilotCommit(**kwargs)
