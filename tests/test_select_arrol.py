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


def test_histogram_calibration_is_laplace_smoothed_bayes_with_the_buffers_prior():
    """Paper A.4. Bins of 0.1: bin 0 holds 1 success and 3 failures, bin 9 two successes, bin 4
    one failure; N+ = 3, N- = 4, prior 3/7; Laplace a = 1 over M = 10 bins. The old rule (raw bin
    rates) gave 0.25, 1.0 (two successes: certainty), 0.0, and an empty bin its raw score."""
    c = HistogramCalibrator(10)
    c.fit([0.05, 0.02, 0.08, 0.01, 0.95, 0.99, 0.42], [1, 0, 0, 0, 1, 1, 0])

    def post(n_pos, n_neg):
        like_pos, like_neg = (n_pos + 1) / (3 + 10), (n_neg + 1) / (4 + 10)
        return 3 / 7 * like_pos / (3 / 7 * like_pos + 4 / 7 * like_neg)

    out = c([0.03, 0.97, 1.0, 0.45, 0.55, 0.0])
    np.testing.assert_allclose(out, [post(1, 3), post(2, 0), post(2, 0), post(0, 1), post(0, 0), post(1, 3)])
    assert 0.28 < out[0] < 0.29 and 0.70 < out[1] < 0.71 and 0.44 < out[4] < 0.45  # worked by hand
    np.testing.assert_allclose(HistogramCalibrator(10)([0.3, 0.8]), [0.3, 0.8])  # no rows yet: the score itself


def test_survival_probabilities_average_kappa_and_stay_in_bounds():
    from agentrl.select.arrol import survival_probabilities

    for probs in ([0.9, 0.85, 0.8, 0.75, 0.7, 0.2, 0.1, 0.05], [0.5] * 6, [0.99, 0.98, 0.97, 0.01], [0.3, 0.6, 0.2]):
        for kappa in (0.25, 0.5, 0.75):
            s = survival_probabilities(probs, kappa)
            assert abs(s.mean() - kappa) < 1e-9 and (s >= 0.1 - 1e-12).all() and (s <= 0.9 + 1e-12).all()
    s = survival_probabilities([0.9] * 6 + [0.1] * 2, 0.5)  # mostly likely wins: the likely losses survive more
    assert s[6] > s[0] and s[6] == s[7] and s[0] == s[5]
    kept_pos = (s * np.array([0.9] * 6 + [0.1] * 2)).sum() / s.sum()
    assert abs(kept_pos - 0.5) < abs(0.7 - 0.5)  # the kept group is expected closer to balance than the group (0.7)


def test_survival_draws_average_kappa_and_every_rollout_keeps_a_chance():
    """The paper's rule is stochastic; the old rule kept exactly ceil(kappa * n), always the same ones."""
    from agentrl.select.arrol import keep_survival

    rng = np.random.default_rng(0)
    probs = [0.95, 0.9, 0.9, 0.85, 0.8, 0.3, 0.1, 0.05]
    draws = np.array([keep_survival(probs, 0.5, rng, min_group=0) for _ in range(5000)])  # sd of the mean ~0.003
    assert abs(draws.mean() - 0.5) < 0.01  # a group's survival draws average kappa
    assert (draws.mean(0) > 0.05).all()  # every rollout survives sometimes
    assert len({d.sum() for d in draws}) > 3  # not a fixed count
    assert sum(keep(probs, 0.5)) == 4 and keep(probs, 0.5) == keep(probs, 0.5)
    few = [keep_survival(probs, 0.1, rng) for _ in range(500)]  # at least 2 stay, so the group keeps an advantage
    assert min(sum(k) for k in few) >= 2


def test_finished_trajectories_count_in_the_balance():
    """Two trajectories won before K: counted, the group is already positive, so both rules lean
    to the running ones likely to fail (the old rule left them out and kept one high, one low)."""
    from agentrl.select.arrol import survival_probabilities

    probs = [0.9, 0.1, 0.8, 0.2]
    assert keep(probs, 0.5) == [True, True, False, False]  # alone: one likely win, one likely loss
    assert keep(probs, 0.5, fixed=[1.0, 1.0]) == [False, True, False, True]  # with two wins: the likely losses
    alone, counted = survival_probabilities(probs, 0.5), survival_probabilities(probs, 0.5, fixed=[1.0, 1.0])
    np.testing.assert_allclose(alone, [0.5] * 4)  # balanced on its own: no correction
    assert min(counted[1], counted[3]) > max(counted[0], counted[2]) and abs(counted.mean() - 0.5) < 1e-9


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
