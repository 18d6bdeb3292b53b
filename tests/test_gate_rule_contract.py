"""The GateRule contract (agentrl.select.gate_rule), checked on every rule a `--gate` spec builds:

- "threshold": `K,d_L`, the fixed CUT_{K,d_L} (with and without the OR-rule);
- "auto": `K,auto`, the threshold fitted online from labelled groups (select/auto_gate.py);
- "classifier": `K,auto:S1+S2`, a logistic classifier on several signals (select/classifier_gate.py);
- "nowin": `K,nowin`, cut a group none of whose rows has ended by K (select/gate_rule.py).

A rule decides from a group's seven signals at K alone (same signals and state, same answer),
learns only through `learn`, and survives a checkpoint: a fresh rule from the same spec loaded
with the saved state decides, reports and reads as the saved one, now and after more learning.
"""

from __future__ import annotations

import json
import random

import pytest

from agentrl.config import GateConfig
from agentrl.env.data import Game
from agentrl.rollout.lockstep import Group
from agentrl.rollout.signals import SIGNALS
from agentrl.rollout.trajectory import Trajectory
from agentrl.select.cut import CutStage, gate_rule
from agentrl.select.gate_rule import GateLabel, GateRule
from agentrl.specs import parse_gate

# spec, --gate-or-tau, whether the rule learns
RULES = {
    "threshold": ("3,0.3", None, False),
    "threshold-or-tau": ("3,0.3", 0.75, False),
    "auto": ("3,auto", None, True),
    "auto-entropy": ("3,auto:entropy", None, True),
    "classifier": ("3,auto:d+obs", None, True),
    "classifier-3": ("3,auto:entropy+bigram+obs", None, True),
    "nowin": ("3,nowin", None, False),
}
AUTO = GateConfig(precision=0.8, min_labels=20)


def make(name: str) -> GateRule:
    spec, tau, _ = RULES[name]
    return gate_rule(parse_gate(spec, tau), AUTO)


def signals(rng: random.Random) -> dict[str, float]:
    out = {s: rng.choice([0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0, rng.random()]) for s in SIGNALS}
    out["action_entropy"] = out["prefix_edit_distance_mean"]  # converged prefixes, converged last actions
    return out


def grid(n: int = 300, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    return [signals(rng) for _ in range(n)]


def labels(seed: int, n: int = 60, audit_rate: float = 0.25) -> list[GateLabel]:
    """Groups whose low d_K (and entropy) at K went with all-equal rewards (what a cut should remove)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = signals(rng)
        converged = s["prefix_edit_distance_mean"] < 0.3
        out.append(GateLabel(s, converged, audited=converged and rng.random() < 0.5, audit_rate=audit_rate))
    return out


@pytest.fixture(params=list(RULES))
def name(request):
    return request.param


def test_it_is_a_gate_rule_with_the_spec_K(name):
    rule = make(name)
    assert isinstance(rule, GateRule)
    assert rule.K == 3 and str(rule).startswith("3,")


def test_it_decides_from_the_signals_alone(name):
    rule = make(name)
    rule.learn(1, labels(1))
    first = [rule.fires(s) for s in grid()]
    assert all(type(f) is bool for f in first)
    assert [rule.fires(dict(s)) for s in grid()] == first  # same signals, same answer, whatever came before
    assert [rule.fires(s) for s in reversed(grid())] == first[::-1]


def test_learning_goes_through_learn_only(name):
    rule, learns = make(name), RULES[name][2]
    before = [rule.fires(s) for s in grid()]
    rule.learn(1, [])  # an iteration that labelled nothing
    assert [rule.fires(s) for s in grid()] == before
    rule.learn(1, labels(1))
    rule.learn(2, labels(2))
    after = [rule.fires(s) for s in grid()]
    if learns:  # an auto rule cuts nothing before its labels, then cuts the converged region
        assert not any(before) and any(after)
        assert isinstance(rule.report(), dict)
    else:
        assert after == before and rule.report() is None and rule.state_dict() == {}


def test_the_state_round_trips_through_a_checkpoint(name):
    saved = make(name)
    for it in (1, 2):
        saved.learn(it, labels(it))
    state = json.loads(json.dumps(saved.state_dict()))  # what a checkpoint stores
    report = saved.report()
    assert report is None or json.loads(json.dumps(report)) == report
    fresh = make(name)
    fresh.load_state_dict(state)
    assert [fresh.fires(s) for s in grid()] == [saved.fires(s) for s in grid()]
    assert fresh.report() == saved.report() and str(fresh) == str(saved)
    for rule in (saved, fresh):  # and they go on alike
        rule.learn(3, labels(3))
    assert [fresh.fires(s) for s in grid(seed=1)] == [saved.fires(s) for s in grid(seed=1)]
    assert fresh.state_dict() == saved.state_dict()


def _group(i: int, s: dict[str, float]) -> Group:
    g = Game(game_id=f"task-{i}/trial", split="train", task_type="pick_and_place_simple", path=None)
    grp = Group(game=g, trajectories=[Trajectory(game=g, index=k, step_tokens=[4, 4, 4, 4]) for k in range(4)])
    grp.signals[3] = s
    return grp


def test_the_cut_stage_cuts_exactly_where_its_rule_fires(name):
    """The stage asks the rule (no comparison of its own), audits a share of what it would cut, and
    feeds the rule the groups that ran to the end."""
    stage, shadow, fired = CutStage(make(name), audit=0.25, seed=5), make(name), 0
    for it in (1, 2, 3):
        stage.begin(it)
        groups = [_group(100 * it + i, s) for i, s in enumerate(grid(40, seed=it))]
        wants = [shadow.fires(g.signals[3]) for g in groups]
        for g in groups:
            stage.at_step(3, g)
        assert [g.cut or g.audited for g in groups] == wants
        fired += sum(wants)
        for g in groups:
            if not g.cut:
                zero = g.signals[3]["prefix_edit_distance_mean"] < 0.3
                for k, t in enumerate(g.trajectories):
                    t.stop_reason = "lost" if zero or k else "won"
        stage.observe(groups)
        shadow.learn(it, [GateLabel(g.signals[3], g.zero_variance, g.audited, 0.25) for g in groups if not g.cut])
        assert stage.rule.state_dict() == shadow.state_dict()
    assert fired > 0 and stage.stats().decisions["groups_cut"] > 0
