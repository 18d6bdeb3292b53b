"""`--gate K,auto`: the threshold fitted on constructed labelled groups whose right answer is known,
the inverse-audit-rate weighting (unbiased where unweighted labels are not), no cut before the
minimum labels, the refusal without an audit, the spec, and the stage's state round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.rollout.lockstep import Group
from agentrl.rollout.signals import SIGNALS
from agentrl.rollout.trajectory import Trajectory
from agentrl.select.auto_gate import AutoThreshold, Label, fit_threshold, read_warmup, wilson
from agentrl.select.cut import CutStage, gate_rule
from agentrl.specs import SIGNAL_NAMES, parse_gate


def test_the_spec_names_a_signal_and_starts_cutting_nothing():
    g = parse_gate("10,auto")
    assert g.auto and g.K == 10 and g.d_L == 0.0 and g.signal == "prefix_edit_distance_mean"
    assert not gate_rule(g).fires({"prefix_edit_distance_mean": 0.0, "termination_fraction": 0.0})  # 0 < 0 is false
    assert parse_gate("5, auto:entropy").signal == "action_entropy"
    tau = parse_gate("3,auto:tau")  # termination_fraction: converged when high, so the score is 1 - tau
    assert tau.signal == "termination_fraction"
    assert SIGNAL_NAMES == SIGNALS
    with pytest.raises(UserError, match="unknown gate signal"):
        parse_gate("10,auto:vibes")
    with pytest.raises(UserError, match="K,auto"):
        parse_gate("10,automatic")
    assert str(parse_gate("10,0.12")) == "10,0.12"


def test_the_nowin_gate_cuts_a_group_with_no_row_ended_by_K_and_nothing_else():
    g = parse_gate(" 10 , NoWin ")
    assert g.nowin and g.K == 10 and str(g) == "10,nowin" and not g.auto
    rule = gate_rule(g)
    assert str(rule) == "10,nowin" and rule.K == 10
    quiet = {s: 0.0 for s in SIGNALS}  # every other signal as converged as it gets: only who ended counts
    assert rule.fires(quiet) and rule.fires({**quiet, "prefix_edit_distance_mean": 1.0})
    assert not rule.fires({**quiet, "termination_fraction": 1 / 8})  # one row won by K: spared
    with pytest.raises(UserError, match="give one of them"):
        parse_gate("10,nowin", tau_H=0.5)
    with pytest.raises(UserError, match="K,nowin"):
        parse_gate("10,nowins")


def test_a_known_separating_threshold_is_found():
    """Zero-variance groups at scores 0.00..0.29, informative ones at 0.31..0.99: the fit cuts
    exactly the zero-variance ones, its threshold between 0.29 and 0.31."""
    labels = [Label(1, i / 100, i < 30, 1.0) for i in range(100) if i != 30]
    fit = fit_threshold(labels, precision=0.8, min_labels=24)
    assert 0.29 < fit.d_L < 0.31 and fit.precision == 1.0 and fit.labelled == 99
    assert fit.cut_share == pytest.approx(30 / 99)
    # with a precision floor it cannot reach anywhere, nothing is cut
    mixed = [Label(1, i / 100, i % 2 == 0, 1.0) for i in range(100)]
    assert fit_threshold(mixed, precision=0.8, min_labels=24).d_L == 0.0
    # some mixing allowed: the widest cut at precision >= 0.8 (the most zero-variance groups removed)
    noisy = [Label(1, i / 100, i < 30 or (30 <= i < 50 and i % 2 == 0), 1.0) for i in range(100)]
    fit = fit_threshold(noisy, precision=0.8, min_labels=1)
    below = [lb for lb in noisy if lb.score < fit.d_L]
    assert sum(lb.zero for lb in below) / len(below) >= 0.8
    wider = [lb for lb in noisy if lb.score < fit.d_L + 0.02]
    assert sum(lb.zero for lb in wider) / len(wider) < 0.8 or sum(lb.zero for lb in wider) == sum(lb.zero for lb in below)


def _population():
    """1,200 groups: scores < 0.2 all zero-variance (A), 0.2..0.4 half (B, alternating), >= 0.4 none (C)."""
    a = [(i / 2000, True) for i in range(400)]
    b = [(0.2 + i / 2000, i % 2 == 0) for i in range(400)]
    c = [(0.4 + i / 2000, False) for i in range(400)]
    return a, b, c


def test_audited_labels_are_weighted_by_the_inverse_audit_rate():
    """A gate at d_L 0.2 with audit rate 1/4 was in force: below it only every 4th group ran on.
    Weighted by 4, those labels give the fit that all 1,200 outcomes give; unweighted, region A
    counts a quarter of its size and the fit stops far short (biased)."""
    a, b, c = _population()
    full = [Label(1, s, z, 1.0) for s, z in a + b + c]
    truth = fit_threshold(full, 0.8, 24)
    audited = [(s, z) for k, (s, z) in enumerate(a) if k % 4 == 0]
    weighted = [Label(1, s, z, 4.0) for s, z in audited] + [Label(1, s, z, 1.0) for s, z in b + c]
    unweighted = [Label(1, s, z, 1.0) for s, z in audited] + [Label(1, s, z, 1.0) for s, z in b + c]
    fit_w, fit_u = fit_threshold(weighted, 0.8, 24), fit_threshold(unweighted, 0.8, 24)
    # the true cut: all of A and the first k of B with (400 + k/2) / (400 + k) >= 0.8, k <= 266
    assert 0.2 + 265 / 2000 < truth.d_L < 0.2 + 268 / 2000
    assert fit_w.d_L == pytest.approx(truth.d_L, abs=1e-3) and fit_w.precision == pytest.approx(truth.precision, abs=1e-3)
    assert fit_u.d_L < 0.2 + 70 / 2000  # unweighted: (100 + k/2) / (100 + k) >= 0.8 stops at k <= 66
    # what each fit's cut really keeps, on all 1,200 groups: the unweighted one gives up most of the saving
    removed = lambda t: sum(z for s, z in a + b + c if s < t)  # noqa: E731
    assert removed(fit_w.d_L) > removed(fit_u.d_L) + 90


def test_no_cut_before_the_minimum_labels():
    auto = AutoThreshold("prefix_edit_distance_mean", precision=0.8, min_labels=24)
    for i in range(23):
        auto.add(1, 0.0, True, audited=False, audit_rate=0.2)
    assert auto.refit(1).d_L == 0.0 and auto.report()["labelled"] == 23
    auto.add(1, 0.5, False, audited=False, audit_rate=0.2)
    assert auto.refit(1).d_L == pytest.approx(0.25)


def test_the_window_keeps_recent_iterations_only():
    auto = AutoThreshold("prefix_edit_distance_mean", precision=0.8, min_labels=4, window=2)
    for i in range(10):  # iteration 1: low scores were zero-variance
        auto.add(1, i / 100, True, audited=False, audit_rate=0.5)
    assert auto.refit(2).d_L > 0  # iteration 1 is in the window ending at 2
    for i in range(10):  # iterations 3, 4: they no longer are
        auto.add(3 + i % 2, i / 100, False, audited=False, audit_rate=0.5)
    assert auto.refit(4).d_L == 0.0 and auto.fit.labelled == 10  # iterations 3-4 only


def test_wilson_against_hand_worked_values():
    lo, hi = wilson(8, 10)  # p 0.8, z 1.96: (0.8 + 0.1921 -+ 1.96 sqrt(0.016 + 0.0096)) / 1.3842
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 0) is None


def game(i: int) -> Game:
    return Game(game_id=f"task-{i}/trial", split="train", task_type="pick_and_place_simple", path=Path("/none"))


def running_group(i: int, d_K: float, K: int = 2) -> Group:
    g = game(i)
    grp = Group(game=g, trajectories=[Trajectory(game=g, index=k, step_tokens=[5, 5]) for k in range(4)])
    grp.signals[K] = {"prefix_edit_distance_mean": d_K, "termination_fraction": 0.0}
    return grp


def end(grp: Group, zero: bool) -> Group:
    for k, t in enumerate(grp.trajectories):
        if t.stop_reason is None:
            t.stop_reason = "lost" if zero or k else "won"
    return grp


def iteration(stage: CutStage, it: int, n: int = 80) -> list[Group]:
    """n groups: d_K < 0.3 ones end all-fail, the rest with reward variance."""
    stage.begin(it)
    groups = [running_group(100 * it + i, (i % 10) / 10) for i in range(n)]
    for g in groups:
        stage.at_step(2, g)
    for g in groups:
        if not g.cut:
            end(g, g.signals[2]["prefix_edit_distance_mean"] < 0.3)
    stage.observe(groups)
    return groups


def auto_cfg(**over):
    return load_config(None, {"rollout.gate": "2,auto", "select.gate_audit": 0.25, "gate.min_labels": 30,
                              "env.max_steps": 5} | over)


def test_the_stage_cuts_only_after_it_has_labels_and_audits_what_it_cuts():
    cfg = auto_cfg()
    stage = CutStage.from_spec(cfg.rollout.parsed_gate(), cfg.select.gate_audit, cfg.seed, cfg.gate)
    first = iteration(stage, 1)
    assert not any(g.cut or g.audited for g in first)  # no labels yet: nothing cut, nothing audited
    rep = stage.stats().extra["auto"]
    assert rep["labelled"] == 80 and 0.2 < rep["d_L"] < 0.3 and rep["precision_fit"] == 1.0
    second = iteration(stage, 2)
    below = [g for g in second if g.signals[2]["prefix_edit_distance_mean"] < 0.3]
    assert all(g.cut or g.audited for g in below) and not any(g.cut or g.audited for g in second if g not in below)
    audited = [g for g in below if g.audited]
    assert 0 < len(audited) < len(below)
    rep = stage.stats().extra["auto"]
    # labels: 80 + the 56 groups it let run + the audited ones (weight 4 each)
    assert rep["labelled"] == 80 + 56 + len(audited) and rep["audited"] == len(audited)
    assert rep["precision_audit"] == 1.0 and rep["precision_audit_ci95"][1] == 1.0
    assert sum(lb.weight for lb in stage.rule.threshold.labels) == 80 + 56 + 4 * len(audited)


def test_the_stage_state_round_trips_and_continues_identically():
    cfg = auto_cfg()
    make = lambda: CutStage.from_spec(cfg.rollout.parsed_gate(), cfg.select.gate_audit, cfg.seed, cfg.gate)  # noqa: E731
    straight, resumed = make(), make()
    for it in (1, 2):
        iteration(straight, it)
        iteration(resumed, it)
    import json

    state = json.loads(json.dumps(resumed.state_dict()))  # what a checkpoint stores
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.rule.d_L == straight.rule.d_L and str(fresh.rule) == str(straight.rule)
    a, b = iteration(straight, 3), iteration(fresh, 3)
    assert [(g.cut, g.audited) for g in a] == [(g.cut, g.audited) for g in b]
    assert straight.stats().extra["auto"] == fresh.stats().extra["auto"]


def test_auto_needs_the_audit_and_a_sane_section():
    with pytest.raises(UserError, match="--gate-audit"):
        load_config(None, {"rollout.gate": "10,auto"})
    with pytest.raises(UserError, match="gate.precision"):
        load_config(None, {"rollout.gate": "10,auto", "select.gate_audit": 0.2, "gate.precision": 0})
    with pytest.raises(UserError, match="gate.min_labels"):
        load_config(None, {"gate.min_labels": 0})
    load_config(None, {"rollout.gate": "10,auto", "select.gate_audit": 0.2})


def test_warmup_labels_come_from_a_groups_table(tmp_path):
    csv = tmp_path / "groups.csv"
    head = "task_id,task_type,K," + ",".join(SIGNALS) + ",rewards,cut\n"
    rows = []
    for i in range(30):
        sig = {s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": i / 30}
        rewards = "0;0;0;0" if i < 10 else "1;0;0;0"
        for K, cut in ((5, 0), (10, int(i == 29))):
            rows.append(f"t{i},pick,{K}," + ",".join(str(sig[s]) for s in SIGNALS) + f",{rewards},{cut}\n")
    csv.write_text(head + "".join(rows))
    labels = read_warmup(csv, 10, "prefix_edit_distance_mean")
    assert len(labels) == 29 and sum(lb.zero for lb in labels) == 10  # K=10 rows; the cut group has no label
    cfg = auto_cfg(**{"gate.warmup": str(csv), "rollout.gate": "10,auto", "env.max_steps": 30, "gate.min_labels": 20})
    stage = CutStage.from_spec(cfg.rollout.parsed_gate(), cfg.select.gate_audit, cfg.seed, cfg.gate)
    assert 9 / 30 < stage.rule.d_L < 10 / 30  # fitted before the first iteration
    with pytest.raises(UserError, match="no uncut group at K=3"):
        read_warmup(csv, 3, "prefix_edit_distance_mean")
