"""GRESO stage: skip probabilities, streaks, the controller, choose(), state round-trip."""

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
from agentrl.select.greso import Greso


def game(i: int) -> Game:
    return Game(game_id=f"task-{i}/trial", split="train", task_type="pick_and_place_simple", path=Path("/none"))


def group(i: int, wins: list[bool], cut: bool = False, tokens: int = 10) -> Group:
    g = game(i)
    trajs = [Trajectory(game=g, index=k, stop_reason="won" if w else "lost", step_tokens=[tokens])
             for k, w in enumerate(wins)]
    return Group(game=g, trajectories=trajs, cut=cut)


EASY, HARD, MIXED = [True] * 4, [False] * 4, [True, False, False, False]


def test_fake_groups_have_the_right_rewards():
    assert group(0, EASY).rewards == [1.0] * 4 and group(0, EASY).zero_variance
    assert group(0, HARD).rewards == [0.0] * 4 and group(0, HARD).zero_variance
    assert not group(0, MIXED).zero_variance


def test_is_a_stage():
    s = Greso()
    assert isinstance(s, Stage) and s.name == "greso" and s.point == "before"


def test_skip_probability():
    s = Greso(p_start=0.5)
    assert s.skip_probability("task-0/trial") == 0.0  # never seen: z = 0
    s.streaks["task-0/trial"] = (2, "hard")
    assert s.skip_probability("task-0/trial") == pytest.approx(0.75)
    s.p["easy"] = 0.9
    s.streaks["task-1/trial"] = (1, "easy")
    assert s.skip_probability("task-1/trial") == pytest.approx(0.1)


def test_streaks_count_reset_and_ignore_cut_groups():
    s = Greso()
    gid = game(0).game_id
    s.observe([group(0, HARD)])
    s.observe([group(0, HARD)])
    assert s.streaks[gid] == (2, "hard")
    s.observe([group(0, EASY, cut=True)])  # no final label: unchanged
    assert s.streaks[gid] == (2, "hard")
    s.observe([group(0, EASY)])  # the other kind: a new streak
    assert s.streaks[gid] == (1, "easy")
    s.observe([group(0, MIXED)])  # variance: z = 0
    assert gid not in s.streaks and s.skip_probability(gid) == 0.0


def past_first_epoch(s: Greso, pool: int = 4) -> Greso:
    s.pool_size, s.considered_total = pool, 2 * pool  # the authors move p only when epoch > 0 (RT 1207)
    return s


def test_controller_steps_and_clamps():
    s = past_first_epoch(Greso(p_start=0.5, step=0.01))  # targets: easy 1/12, hard 1/6
    s.observe([group(0, EASY), group(1, MIXED), group(2, MIXED), group(3, MIXED)])  # easy 0.25 >= 1/12; hard 0 < 1/6
    assert s.p["easy"] == pytest.approx(0.49) and s.p["hard"] == pytest.approx(0.51)
    s.observe([group(0, EASY, cut=True)])  # no labelled group: no step
    assert s.p["easy"] == pytest.approx(0.49) and s.p["hard"] == pytest.approx(0.51)
    s = past_first_epoch(Greso(p_start=0.06, p_min=0.05, step=0.02))
    s.observe([group(0, HARD)])
    assert s.p["hard"] == pytest.approx(0.05) and s.p["easy"] == pytest.approx(0.08)
    s = past_first_epoch(Greso(p_start=0.945, step=0.01))
    s.observe([group(0, MIXED)])
    assert s.p["easy"] == 0.95 and s.p["hard"] == 0.95  # authors' max_p (RT 1204): skipping never switches off


def test_at_exactly_the_target_p_goes_down():
    """The authors compare with >= (RT 1208): at the target, skip more. The old rule (>) raised p."""
    s = past_first_epoch(Greso(p_start=0.5, target_easy=0.25, target_hard=0.5))
    s.observe([group(0, EASY), group(1, HARD), group(2, HARD), group(3, MIXED)])  # easy 0.25, hard 0.5: exactly
    assert s.p["easy"] == pytest.approx(0.49) and s.p["hard"] == pytest.approx(0.49)


def test_p_stays_put_during_the_first_epoch():
    s = Greso(p_start=0.5, pool_size=8)
    s.choose([game(i) for i in range(4)], want=4)  # half the pool: still epoch 0
    s.observe([group(i, EASY) for i in range(4)])
    assert s.p == {"easy": 0.5, "hard": 0.5} and s.streaks[game(0).game_id] == (1, "easy")  # streaks do count
    s.choose([game(i) for i in range(4, 8)], want=4)  # the rest of the pool: the first pass completes
    s.observe([group(i, EASY) for i in range(4, 8)])
    assert s.p == {"easy": 0.5, "hard": 0.5} and s.epoch == 1
    s.choose([game(i) for i in range(4)], want=4)  # epoch 1: the controller runs
    s.observe([group(i, EASY) for i in range(4)])
    assert s.p["easy"] == pytest.approx(0.49) and s.p["hard"] == pytest.approx(0.51)


def test_a_long_streak_keeps_one_percent():
    """skip = 1 - max(p**z, 0.01) (PS 117, 142): p = 0.05 and z = 2 keeps 1% (the old rule 0.25%)."""
    s = Greso(p_start=0.05)
    s.streaks["task-0/trial"] = (2, "hard")
    assert s.skip_probability("task-0/trial") == pytest.approx(0.99)
    s.streaks["task-0/trial"] = (40, "hard")
    assert s.skip_probability("task-0/trial") == pytest.approx(0.99)  # never practically forever
    s = Greso(seed=5, p_start=0.05)
    s.streaks = {game(i).game_id: (30, "hard") for i in range(20000)}
    kept = s.choose([game(i) for i in range(20000)], want=20000)
    assert 140 < len(kept) < 270  # 1% of 20000 = 200


def test_a_refill_round_passes_through_greso():
    """DAPO refill rounds draw their tasks through GRESO's coin (RT 988-1016), within the same
    iteration's accounting; before, they came straight from the pool."""
    import types

    from agentrl.config import load_config
    from agentrl.select.selection import Selection

    pool = [game(i) for i in range(40)]
    tasks = types.SimpleNamespace(pool=pool, stream=lambda: list(pool), select=lambda n: pool[:n])
    sel = Selection(load_config(None, {"select.stages": "greso,dapo", "rollout.gate": "off"}))
    greso = sel.by_name["greso"]
    greso.streaks = {g.game_id: (30, "easy") for g in pool[:20]}  # 99% skipped
    first = greso.choose(tasks.stream(), 4)
    refill = sel.refill_tasks(tasks, 4)
    skipped_ids = {g.game_id for g in pool[:20]}
    assert len(refill) == 4 and sum(g.game_id in skipped_ids for g in first + refill) <= 1  # the coin kept them out
    # (the old refill, tasks.select(4), took pool[:4]: four streaky tasks)
    assert greso.stats().decisions["tasks_considered"] >= 40  # both rounds counted: one iteration


def test_pilot_groups_leave_streaks_alone_unless_asked():
    pilot = group(0, [True, True])
    pilot.excluded_by = "pilot-commit"
    s = Greso()
    s.observe([pilot])
    assert s.streaks == {}
    s = Greso(count_pilots=True)
    s.observe([pilot])
    assert s.streaks == {game(0).game_id: (1, "easy")}


def test_choose_skips_with_the_right_frequency():
    s = Greso(seed=123, p_start=0.5)
    s.streaks = {game(i).game_id: (2, "hard") for i in range(1000)}  # skip probability 0.75 each
    chosen = s.choose([game(i) for i in range(1000)], want=100)
    assert len(chosen) == 100 and len({g.game_id for g in chosen}) == 100
    d = s.stats().decisions
    assert d["tasks_considered"] == d["tasks_skipped"] + 100
    assert 0.65 < d["tasks_skipped"] / d["tasks_considered"] < 0.85


def test_choose_refills_from_the_stream():
    s = Greso(seed=1, p_start=0.05)
    s.streaks = {game(i).game_id: (8, "easy") for i in range(10)}  # skip probability ~1
    chosen = s.choose([game(i) for i in range(20)], want=5)
    assert [g.game_id for g in chosen] == [game(i).game_id for i in range(10, 15)]
    assert s.stats().decisions == {"tasks_skipped": 10, "tasks_considered": 15}
    assert len(Greso().choose([game(0), game(1), game(0)], want=5)) == 2  # the stream runs out; repeats dropped


def test_stats_tokens_avoided_and_reset():
    s = Greso(seed=0, p_start=0.05)
    s.streaks = {game(i).game_id: (8, "hard") for i in range(3)}
    s.choose([game(i) for i in range(6)], want=3)
    s.observe([group(3, MIXED, tokens=10), group(4, MIXED, tokens=20), group(5, MIXED, tokens=30)])  # 40, 80, 120
    st = s.stats()
    assert st.decisions["tasks_skipped"] == 3
    assert st.step_tokens_avoided == 3 * 80 and st.precision is None
    assert set(st.extra) == {"p_easy", "p_hard", "epoch"}
    s.choose([], want=3)
    assert s.stats().decisions == {"tasks_skipped": 0, "tasks_considered": 0}
    assert s.stats().step_tokens_avoided == 0


def test_state_round_trip_continues_identically():
    a = Greso(seed=7)
    for _ in range(3):
        a.choose([game(i) for i in range(20)], want=8)
        a.observe([group(i, HARD if i % 3 else EASY) for i in range(8)])
    b = Greso(seed=999)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.p == a.p and b.streaks == a.streaks
    index = {game(i).game_id: i for i in range(40)}
    stream = [game(i) for i in range(40)]
    for _ in range(5):
        ca, cb = a.choose(stream, want=10), b.choose(stream, want=10)
        assert ca == cb
        a.observe([group(index[g.game_id], HARD) for g in ca])
        b.observe([group(index[g.game_id], HARD) for g in cb])
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("kwargs, message", [
    ({"p_min": 2}, "greso: p_min must be in (0, 1], got 2"),
    ({"p_min": 0}, "p_min"),
    ({"p_start": 0.01}, "p_start"),
    ({"step": -0.1}, "step"),
    ({"target_easy": 1.5}, "target_easy"),
    ({"target_hard": -1}, "target_hard"),
    ({"seed": -1}, "seed"),
])
def test_invalid_parameters(kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        Greso(**kwargs)
