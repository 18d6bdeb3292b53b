"""The CUT gate and its online audit, the DAPO filter with refill, Pilot-Commit's merge, the
`--select` list, and the accounting, on hand-made groups with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.rollout.lockstep import Group, Rollout, RolloutStats
from agentrl.rollout.trajectory import Trajectory
from agentrl.select import STAGES, stage_names
from agentrl.select.cut import CutStage
from agentrl.select.dapo import DapoFilter
from agentrl.select.gate_rule import Threshold
from agentrl.select.selection import Selection, merge_group
from agentrl.train.advantage import batch_advantages


def game(i: int) -> Game:
    return Game(game_id=f"task-{i}/trial", split="train", task_type="pick_and_place_simple", path=Path("/none"))


def group(i: int, wins: list[bool | None], tokens: int = 10, d_K: float = 0.5, first: int = 0) -> Group:
    """None: a trajectory still running at K."""
    g = game(i)
    trajs = [Trajectory(game=g, index=first + k, stop_reason=None if w is None else ("won" if w else "lost"),
                        step_tokens=[tokens // 2, tokens - tokens // 2]) for k, w in enumerate(wins)]  # 2 steps by K
    grp = Group(game=g, trajectories=trajs)
    grp.signals[2] = {"prefix_edit_distance_mean": d_K, "termination_fraction": 0.0}
    return grp


def finish(grp: Group, wins: list[bool]) -> Group:
    for t, w in zip(grp.trajectories, wins):
        if t.stop_reason is None:
            t.stop_reason, t.step_tokens = ("won" if w else "lost"), t.step_tokens + [5]
    return grp


def test_cut_fires_below_d_L_and_leaves_finished_groups_alone():
    stage = CutStage(Threshold(2, 0.12))
    converged, diverse, done = group(0, [None] * 4, d_K=0.05), group(1, [None] * 4, d_K=0.3), group(2, [True] * 4, d_K=0.0)
    for g in (converged, diverse, done):
        stage.at_step(2, g)
    assert converged.cut and converged.cut_step == 2 and all(t.stop_reason == "gate_cut" for t in converged.trajectories)
    assert not diverse.cut and not done.cut  # a finished group has nothing left to save
    stage.observe([converged, finish(diverse, [True, False, True, False]), done])
    st = stage.stats()
    assert st.decisions == {"groups_cut": 1, "groups_audited": 0} and st.step_tokens_excluded == 40
    assert st.step_tokens_avoided == 4 * 5  # 4 trajectories stopped x 5 tokens each after K in groups that ran on
    assert batch_advantages([converged, diverse, done]) and all(t.game.game_id != converged.game.game_id
                                                                for t, _ in batch_advantages([converged, diverse, done]))


def test_the_audit_lets_its_share_run_on_out_of_the_loss_and_measures_precision_and_recall():
    stage = CutStage(Threshold(2, 0.12), audit=0.25, seed=7)
    stage.begin(1)
    groups = [group(i, [None] * 4, d_K=0.0) for i in range(400)]
    for g in groups:
        stage.at_step(2, g)
    audited = [g for g in groups if g.audited]
    assert 0.18 < len(audited) / len(groups) < 0.32  # about the audit share, fixed by (seed, iteration, task)
    assert all(not g.cut and g.excluded_by == "cut" for g in audited) and sum(g.cut for g in groups) == 400 - len(audited)
    # ground truth: 3 of 4 audited groups end all-fail (the gate was right), 1 of 4 ends mixed
    for k, g in enumerate(audited):
        finish(g, [False] * 4 if k % 4 else [True, False, False, False])
    missed = [finish(group(1000 + i, [None] * 4, d_K=0.9), [False] * 4) for i in range(10)]  # zero-variance it let run
    stage.observe(groups + missed)
    st = stage.stats()
    right = sum(1 for k in range(len(audited)) if k % 4)
    assert st.precision == pytest.approx(right / len(audited))
    would_cut_zero = st.precision * 400
    assert st.extra["recall_est"] == pytest.approx(would_cut_zero / (would_cut_zero + 10))
    assert batch_advantages(audited) == []  # the audit never changes what is trained
    again = CutStage(Threshold(2, 0.12), audit=0.25, seed=7)
    again.begin(1)
    twins = [group(i, [None] * 4, d_K=0.0) for i in range(400)]
    for g in twins:
        again.at_step(2, g)
    assert [g.audited for g in twins] == [g.audited for g in groups]  # reproducible


def test_dapo_filters_zero_variance_groups_and_refills_up_to_its_limit():
    calls = []

    def refill(n):
        calls.append(n)
        return [finish(group(100 + len(calls), [None] * 4), [True, True, True, True]),  # zero-variance again
                finish(group(200 + len(calls), [None] * 4), [True, False, True, False])][:n]

    mixed = finish(group(0, [None] * 4), [True, False, False, False])
    groups = [mixed, finish(group(1, [None] * 4), [False] * 4), finish(group(2, [None] * 4), [True] * 4)]
    stage = DapoFilter(refill=1)
    kept = stage.keep(groups, refill=refill, want=3)
    assert calls == [2]  # one round, for the two dropped groups
    assert [g.game.game_id for g in kept if not g.excluded_by] == ["task-0/trial", "task-201/trial"]
    st = stage.stats()
    assert st.decisions == {"groups_filtered": 3, "refill_rounds": 1, "refill_groups": 2}
    assert st.step_tokens_excluded == 3 * 4 * 15
    assert DapoFilter().keep(groups) == [g for g in groups]  # no refill without a limit


def test_pilot_and_commit_trajectories_form_one_group():
    pilot = finish(group(0, [None] * 2), [True, False])
    commit = finish(group(0, [None] * 2, first=2), [True, True])
    one = merge_group(pilot, commit)
    assert [t.index for t in one.trajectories] == [0, 1, 2, 3] and one.rewards == [1.0, 0.0, 1.0, 1.0]
    assert one.carried_step_tokens == 0 and merge_group(pilot, commit, carried=20).carried_step_tokens == 20
    assert [t.index for t, _ in batch_advantages([one])] == [0, 1, 2, 3]  # GRPO over pilot + commit (T 659-661)


def test_select_list_is_ordered_by_stage_point_and_checked():
    assert stage_names(load_config(None, {"select.stages": "dapo,cut,greso"})) == ["greso", "cut", "dapo"]
    assert stage_names(load_config()) == ["cut"]  # the gate is on by default
    assert stage_names(load_config(None, {"rollout.gate": "off"})) == []  # no stage unless the gate is on or one is selected
    assert stage_names(load_config(None, {"rollout.gate": "off", "select.stages": "dapo"})) == ["dapo"]
    assert list(STAGES) == ["greso", "pilot-commit", "cut", "arrol", "dapo"]
    for overrides, message in [
        ({"select.stages": "gresso"}, r"unknown selection stage 'gresso' \(did you mean 'greso'\?\)"),
        ({"select.stages": "cut", "rollout.gate": "off"}, "--select cut needs a gate"),
        ({"select.gate_audit": 1.5}, r"select.gate_audit must be in \[0, 1\]"),
        ({"select.stages": "dapo", "select.gate_audit": 0.1}, "audits the gate: select cut too"),
        ({"select.stages": "greso", "select.greso.p_min": 0.0}, "select.greso needs 0 < p_min"),
        ({"select.stages": "pilot-commit", "select.pilot_commit.n_pilot": 8}, r"n_pilot must be auto or in \[1, G=8\)"),
        ({"select.stages": "arrol", "select.arrol.kappa": 0}, r"kappa must be in \(0, 1\]"),
    ]:
        with pytest.raises(UserError, match=message):
            load_config(None, overrides)


def test_accounting_adds_up():
    cfg = load_config(None, {"select.stages": "cut,dapo", "rollout.gate": "2,0.12"})
    sel = Selection(cfg)
    sel.begin(1)
    groups = [group(0, [None] * 4, d_K=0.0), group(1, [None] * 4), group(2, [None] * 4)]
    for g in groups:
        sel.step_stages[0].at_step(2, g)
    finish(groups[1], [True, False, False, True])
    finish(groups[2], [True] * 4)
    kept = sel.keep(Rollout(groups, RolloutStats()), refill=None, B=3)
    batch = batch_advantages(kept)
    sel.observe(groups)
    m = sel.metrics(groups, batch)
    trained = sum(sum(t.step_tokens) for t, a in batch if a != 0.0)
    assert m["step_tokens_generated"] == trained + m["step_tokens_excluded_by_stages"] + m["step_tokens_zero_advantage"]
    assert m["stages"]["cut"]["decisions"]["groups_cut"] == 1 and m["stages"]["dapo"]["decisions"]["groups_filtered"] == 1
