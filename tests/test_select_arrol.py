"""ARRoL stage: the keep rule, cold start, the online quality head, calibration, state."""

import itertools
import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.errors import UserError
from agentrl.select.arrol import Arrol, HistogramCalibrator, keep
from agentrl.select.base import Stage


def _variance(p):
    m, s = len(p), sum(p)
    return ((m - 1) * s - s * s + sum(x * x for x in p)) / m**2


def test_keep_one_high_one_low():
    assert keep([0.9, 0.8, 0.2, 0.1], 0.5) == [True, False, False, True]
    assert keep([0.1, 0.9, 0.8, 0.2], 0.5) == [True, True, False, False]


def test_keep_small_groups_and_minimum_two():
    assert keep([], 0.5) == []
    assert keep([0.3], 0.5) == [True]
    assert keep([0.9, 0.9], 0.1) == [True, True]
    kept = keep([0.9, 0.8, 0.7, 0.2, 0.1, 0.05], 0.1)  # ceil(0.6) = 1 -> m = 2
    assert kept == [True, False, False, False, False, True]
    assert keep([0.9, 0.8, 0.2], 0.5).count(True) == 2
    assert keep([0.9, 0.8, 0.2, 0.1], 1.0) == [True] * 4


def test_keep_ties_by_index_and_balance():
    assert keep([0.5] * 4, 0.5) == [True, True, False, False]
    assert keep([0.0] * 5, 0.4) == [True, True, False, False, False]
    # all likely successes: keep the two least likely (mean 0.75, closest to balance)
    assert keep([0.9, 0.9, 0.8, 0.7], 0.5) == [False, False, True, True]


def test_keep_is_exact_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(3, 8)
        probs = [rng.choice([0.0, 0.1, 0.5, 0.9, 1.0, rng.random()]) for _ in range(n)]
        kappa = rng.choice([0.25, 0.5, 0.75])
        kept = keep(probs, kappa)
        m = sum(kept)
        assert m == min(n, max(2, int(np.ceil(kappa * n))))
        best = max(_variance([probs[j] for j in c]) for c in itertools.combinations(range(n), m))
        assert _variance([p for p, k in zip(probs, kept) if k]) == pytest.approx(best, abs=1e-9)


def test_cold_start_and_head_trains_meanwhile():
    a = Arrol(4, cold_start=2, width=8)
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    before = a.raw_probs(x)
    assert not a.should_prune() and not a.should_prune(1) and a.should_prune(2)
    a.observe_features(x, [1.0] * 10 + [0.0] * 10)
    a.observe([])
    assert not a.should_prune()
    assert not np.allclose(before, a.raw_probs(x))  # it trained during the cold start
    a.observe([])
    assert a.should_prune()


def _separable(n, h, seed):
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] > 0).float().tolist()


def test_head_learns_separable_problem():
    a = Arrol(8, seed=0)
    for b in range(8):  # 400 rows in 8 iterations
        a.observe_features(*_separable(50, 8, seed=b))
    x, y = _separable(500, 8, seed=99)
    p = a.predict(x)
    assert ((p > 0.5) == np.array(y, dtype=bool)).mean() > 0.9
    assert a.stats().extra["brier"] < 0.15  # scored on the last batch before training on it
    assert 0.0 <= p.min() and p.max() <= 1.0


def test_deterministic_given_seed():
    preds = []
    for _ in range(2):
        a = Arrol(8, seed=3, width=16)
        for b in range(3):
            a.observe_features(*_separable(40, 8, seed=b))
        preds.append(a.predict(_separable(30, 8, seed=7)[0]))
    np.testing.assert_array_equal(preds[0], preds[1])


def test_histogram_calibration_maps_bins_to_empirical_rates():
    c = HistogramCalibrator(10)
    c.fit([0.05, 0.02, 0.08, 0.01, 0.95, 0.99, 0.42], [1, 0, 0, 0, 1, 1, 0])
    out = c([0.03, 0.97, 1.0, 0.45, 0.55, 0.0])
    np.testing.assert_allclose(out, [0.25, 1.0, 1.0, 0.0, 0.55, 0.25])  # 0.55: empty bin -> raw


def test_state_round_trip_identical_predictions(tmp_path):
    a = Arrol(8, seed=0, width=16, cold_start=0)
    for b in range(3):
        a.observe_features(*_separable(40, 8, seed=b))
    a.observe([])
    state = a.state_dict()
    tensors = {f"head.{k}": v for k, v in state["head"].items()}
    tensors |= {f"buffer.{k}": v for k, v in state["buffer"].items()}
    save_file(tensors, tmp_path / "arrol.safetensors")
    rest = json.loads(json.dumps({k: v for k, v in state.items() if k not in ("head", "buffer")}))
    loaded = load_file(tmp_path / "arrol.safetensors")
    rest["head"] = {k[5:]: v for k, v in loaded.items() if k.startswith("head.")}
    rest["buffer"] = {k[7:]: v for k, v in loaded.items() if k.startswith("buffer.")}
    b = Arrol(8, seed=5, width=16, cold_start=0)
    b.load_state_dict(rest)
    x = _separable(30, 8, seed=7)[0]
    np.testing.assert_array_equal(a.predict(x), b.predict(x))
    assert b.iteration == 1 and len(b.rewards) == 120
    b.observe_features(*_separable(10, 8, seed=8))  # trains after load (fresh Adam)
    with pytest.raises(UserError, match="hidden_size"):
        Arrol(4).load_state_dict(state)


def test_buffer_is_bounded():
    a = Arrol(4, width=8, buffer_size=50, train_steps=1)
    for b in range(3):
        a.observe_features(*_separable(30, 4, seed=b))
    assert len(a.features) == len(a.rewards) == 50


def test_stats_and_protocol():
    a = Arrol(4, width=8)
    assert isinstance(a, Stage) and a.name == "arrol" and a.point == "step"
    a.record_prune(2, 100, 300)
    a.record_prune(0, 0, 0)
    a.record_prune(1, 40, 90)
    a.observe([])
    s = a.stats()
    assert s.decisions == {"trajectories_pruned": 3, "groups_pruned": 2}
    assert (s.step_tokens_generated, s.step_tokens_excluded, s.step_tokens_avoided) == (140, 140, 390)
    assert s.precision is None and "precision" not in s.row()
    a.should_prune()  # the next iteration starts: accounting resets
    assert a.stats().decisions == {"trajectories_pruned": 0, "groups_pruned": 0}


@pytest.mark.parametrize("kwargs, msg", [
    ({"kappa": 1.5}, "arrol: kappa must be in (0, 1], got 1.5"),
    ({"kappa": 0}, "kappa must be in (0, 1]"),
    ({"K": 0}, "K must be an integer >= 1"),
    ({"cold_start": -1}, "cold_start must be an integer >= 0"),
    ({"bins": 0}, "bins must be an integer >= 1"),
    ({"lr": 0.0}, "lr must be > 0"),
    ({"hidden_size": 0}, "hidden_size must be an integer >= 1"),
    ({"buffer_size": 0}, "buffer_size must be an integer >= 1"),
])
def test_invalid_parameters(kwargs, msg):
    with pytest.raises(UserError) as e:
        Arrol(**({"hidden_size": 4} | kwargs))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_feature_shape_checked():
    with pytest.raises(ValueError, match=r"\[n, 4\]"):
        Arrol(4, width=8).predict(torch.zeros(3, 5))
