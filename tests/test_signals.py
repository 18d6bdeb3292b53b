import math

import pytest

from agentrl.errors import UserError
from agentrl.rollout.signals import SIGNALS, compute_signals, d_K
from agentrl.select.gate_rule import Threshold
from agentrl.specs import GateSpec, parse_gate


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
