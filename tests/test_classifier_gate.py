"""The classifier gate (`--gate K,auto:S1+S2+...`, select/classifier_gate.py) on constructed label
sets: a signal that separates, one that carries nothing, inverse-audit weights that change the
cut, the OR-rule, the spec, and warm-up labels from a groups table. (Its GateRule contract,
checkpoint round trip included, is in tests/test_gate_rule_contract.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentrl.config import GateConfig, load_config
from agentrl.errors import UserError
from agentrl.rollout.signals import SIGNALS
from agentrl.select.classifier_gate import ClassifierGate, cross_fitted, fit_logistic
from agentrl.select.cut import CutStage, gate_rule
from agentrl.select.gate_rule import GateLabel
from agentrl.specs import parse_gate

D, OBS = "prefix_edit_distance_mean", "obs_unique_ratio"


def signals(**given: float) -> dict[str, float]:
    return {s: 0.5 for s in SIGNALS} | given


def test_the_spec_names_several_signals():
    spec = parse_gate("5,auto:d+obs+entropy")
    assert spec.auto and spec.K == 5 and spec.signals == (D, OBS, "action_entropy")
    assert str(spec) == f"5,auto:{D}+{OBS}+action_entropy"  # the threshold is fitted as it runs: none printed
    rule = gate_rule(spec, GateConfig())
    assert isinstance(rule, ClassifierGate) and rule.signals == spec.signals
    assert parse_gate("5,auto:obs").signals == ()  # one signal: the fitted threshold, as before
    with pytest.raises(UserError, match="two or more distinct signals"):
        parse_gate("5,auto:d+d_k")
    with pytest.raises(UserError, match="unknown gate signal 'nope'"):
        parse_gate("5,auto:d+nope")


def test_a_separating_signal_is_found_and_a_noise_signal_is_not_used():
    """Zero-variance groups are exactly those with obs < 0.3; d is noise. The rule cuts the low-obs
    region and nothing else, and its weight is on obs."""
    rng = random.Random(0)
    labels = []
    for _ in range(80):
        s = signals(**{D: rng.random(), OBS: rng.random()})
        labels.append(GateLabel(s, s[OBS] < 0.3, audited=False, audit_rate=0.25))
    rule = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    rule.learn(1, labels)
    report = rule.report()
    assert report["precision_fit"] >= 0.8 and abs(report["coef"][OBS]) > 5 * abs(report["coef"][D])
    assert rule.fires(signals(**{D: 0.9, OBS: 0.05})) and rule.fires(signals(**{D: 0.1, OBS: 0.1}))
    assert not rule.fires(signals(**{D: 0.05, OBS: 0.9})) and not rule.fires(signals(**{D: 0.5, OBS: 0.6}))


def test_signals_that_carry_nothing_cut_nothing():
    rng = random.Random(1)
    labels = [GateLabel(signals(**{D: rng.random(), OBS: rng.random()}), rng.random() < 0.5, False, 0.25)
              for _ in range(120)]
    rule = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    rule.learn(1, labels)
    assert rule.model is None and rule.report()["coef"] is None
    assert not any(rule.fires(signals(**{D: x, OBS: y})) for x in (0.0, 0.5, 1.0) for y in (0.0, 0.5, 1.0))


def _audit_labels(audit_rate: float) -> list[GateLabel]:
    """Low region (d 0.1): 10 audited zero-variance groups and 4 informative ones the gate did not
    cut; high region (d 0.8): 30 informative ones. Unweighted the low region is 10/14 = 0.71
    zero-variance, below the 0.8 floor; each audited group standing for 1/a groups it is 40/44."""
    low = [GateLabel(signals(**{D: 0.1, OBS: 0.2}), True, True, audit_rate) for _ in range(10)]
    low += [GateLabel(signals(**{D: 0.1, OBS: 0.2}), False, False, audit_rate) for _ in range(4)]
    high = [GateLabel(signals(**{D: 0.8, OBS: 0.7}), False, False, audit_rate) for _ in range(30)]
    return low + high


def test_inverse_audit_weights_change_the_cut():
    weighted, unweighted = (ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20) for _ in range(2))
    weighted.learn(1, _audit_labels(0.25))
    unweighted.learn(1, _audit_labels(1.0))  # audit rate 1: every audited group stands for itself
    low = signals(**{D: 0.1, OBS: 0.2})
    assert weighted.fires(low) and weighted.report()["precision_fit"] == pytest.approx(40 / 44, abs=1e-4)
    assert not unweighted.fires(low) and unweighted.model is None


def _won_labels(all_success: int) -> list[GateLabel]:
    """Low obs (0.1): 20 all-fail groups (no row ended by K) and 10 informative ones that already
    have a win (termination_fraction 0.125); high obs (0.8): 30 informative, no win yet. Plus
    `all_success` zero-variance groups at low obs whose rows are winning (termination 0.5)."""
    low = [GateLabel(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.0}), True, False, 0.25) for _ in range(20)]
    low += [GateLabel(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.125}), False, False, 0.25) for _ in range(10)]
    low += [GateLabel(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.5}), True, False, 0.25)
            for _ in range(all_success)]
    high = [GateLabel(signals(**{D: 0.5, OBS: 0.8, "termination_fraction": 0.0}), False, False, 0.25) for _ in range(30)]
    return low + high


def test_the_guard_spares_a_group_with_a_win_where_it_removes_more():
    """A score on obs alone cannot tell the low region's all-fail groups (20) from its informative
    ones that already won (10): 20/30 = 0.67, below the floor, so the plain cut takes nothing. With
    the groups in which a row has ended spared, the low region is 20/20: the guard holds, and a
    group with a win is never cut."""
    rule = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    rule.learn(1, _won_labels(all_success=0))
    assert rule.guard and rule.report()["guard"] is True and rule.report()["precision_fit"] == pytest.approx(1.0)
    assert rule.fires(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.0}))
    assert not rule.fires(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.125}))
    assert not rule.fires(signals(**{D: 0.5, OBS: 0.8, "termination_fraction": 0.0}))


def test_the_guard_stays_off_where_all_success_groups_make_the_plain_cut_remove_more():
    """With 60 all-success groups (rows winning by K) in the low region, the plain cut there is
    80/90 = 0.89 zero-variance and removes 80; the guarded one would remove only the 20 all-fail."""
    rule = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    rule.learn(1, _won_labels(all_success=60))
    assert not rule.guard and rule.report()["precision_fit"] == pytest.approx(80 / 90, abs=1e-4)
    assert rule.fires(signals(**{D: 0.5, OBS: 0.1, "termination_fraction": 0.5}))


def test_the_guard_survives_a_checkpoint_and_an_old_checkpoint_loads():
    rule = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    rule.learn(1, _won_labels(all_success=0))
    fresh = ClassifierGate(3, (D, OBS), precision=0.8, min_labels=20)
    fresh.load_state_dict(rule.state_dict())
    assert fresh.guard and fresh.report() == rule.report()
    old = rule.state_dict()
    for e in old["examples"]:
        del e["ended"]  # written before the guard: no group counts as ended, so the guard finds nothing to spare
    fresh.load_state_dict(old)
    assert not fresh.guard and fresh.model is None


def test_the_or_rule_fires_before_any_fit():
    rule = ClassifierGate(3, (D, OBS), tau_H=0.75, min_labels=20)
    assert rule.fires(signals(termination_fraction=0.75)) and not rule.fires(signals(termination_fraction=0.5))


def test_held_out_probabilities_do_not_see_their_own_label():
    """Cross-fitting: an example whose label contradicts its region gets its probability from the
    other folds, which never saw that label: higher than the model fitted on all labels gives it."""
    X = np.array([[0.1, 0.0]] * 20 + [[0.9, 0.0]] * 20)
    y = np.array([1.0] * 20 + [0.0] * 20)
    y[0] = 0.0  # one contradicting label in the zero-variance region
    w = np.ones(40)
    held = cross_fitted(X, y, w)
    assert held[1] > 0.5 and held[25] < 0.5  # the regions are learned
    full = fit_logistic(X, y, w).p(X)
    assert held[0] > full[0] > 0.5


def test_warmup_rows_come_from_a_groups_table(tmp_path):
    csv = tmp_path / "groups.csv"
    rows = ["task_id,task_type,K," + ",".join(SIGNALS) + ",rewards,cut\n"]
    for i in range(40):
        sig = signals(**{D: 0.5, OBS: i / 40})
        rewards = "0;0;0;0" if i < 12 else "1;0;0;0"
        rows.append(f"t{i},pick,4," + ",".join(str(sig[s]) for s in SIGNALS) + f",{rewards},0\n")
    csv.write_text("".join(rows))
    cfg = load_config(None, {"rollout.gate": "4,auto:d+obs", "select.gate_audit": 0.25, "gate.min_labels": 20,
                             "gate.warmup": str(csv), "env.max_steps": 10})
    stage = CutStage.from_spec(cfg.rollout.parsed_gate(), cfg.select.gate_audit, cfg.seed, cfg.gate)
    assert isinstance(stage.rule, ClassifierGate) and len(stage.rule.examples) == 40
    assert all(e.ended for e in stage.rule.examples)  # termination_fraction 0.5 in every row: the guard's input
    assert stage.rule.fires(signals(**{D: 0.5, OBS: 0.05})) and not stage.rule.fires(signals(**{D: 0.5, OBS: 0.9}))
