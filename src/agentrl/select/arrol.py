"""ARRoL for multi-turn agents: prune trajectories inside a group at env step K.

After ARRoL (seed paper 003): a small quality head predicts, from the policy's own hidden state,
whether a partial rollout will succeed, and the rollout keeps only a subset of each group whose
predicted outcomes are balanced, so the group still carries a learning signal while the pruned
trajectories stop generating. Adapted here to ALFWorld agents:

- features: the policy's last hidden state at the end of the trajectory's step-K turn (given to
  us detached, [n, hidden_size]; the backbone is never trained by this head);
- head: a 2-layer MLP on standardised features, trained online (BCE with logits, Adam) on a
  bounded replay buffer of (features, final reward) rows; deterministic on CPU given `seed`;
- calibration (paper A.4): the sigmoid score falls in one of M equal-width bins; per bin the
  buffer's positive and negative counts, Laplace-smoothed class-conditional likelihoods
  P(b|+) = (n+_b + a) / (N+ + a M) (and for -), and the posterior by Bayes' rule with the
  buffer's prior pi = N+ / N: p = pi P(b|+) / (pi P(b|+) + (1 - pi) P(b|-)); M = 10, a = 1;
- rule `survival` (the paper's, default; A.4): each running trajectory survives with
  probability s_i = clip(beta - lambda (pbar - rho) (p_i - rho), s_min, s_max), an affine
  function of its posterior's deviation from the target positive ratio rho = 0.5 whose slope
  is set by the group's imbalance pbar - rho (pbar: the group's mean, trajectories that already
  finished counted with their real outcome), so surviving groups drift toward balance; the bias
  beta is found by bisection so the running trajectories' mean survival is kappa. Every rollout
  keeps a chance: s_min > 0. The text we have lost the constants: we use s_min = 0.1,
  s_max = 0.9 and lambda = 8 (at lambda = 1 a 6:2 group moves its survival by only 0.05);
  at least 2 trajectories of a group stay (finished ones included), so it keeps an advantage;
- rule `deterministic` (an option, the earlier agentrl rule): keep exactly ceil(kappa * r) of
  the r running trajectories, maximising the kept group's expected reward variance;
- trajectories that finished before K are never pruned and count in the balance of both rules;
- cold start: no pruning during the first `cold_start` iterations; the head still trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from agentrl.errors import UserError
from agentrl.select.base import StageStats


RULES = ("survival", "deterministic")


def keep(probs: Sequence[float], kappa: float, fixed: Sequence[float] = ()) -> list[bool]:
    """The `deterministic` rule: which running trajectories of a group to keep, given their
    predicted success probabilities; `fixed`: the real outcomes of the group's trajectories that
    already finished (always kept, counted in the balance).

    Keeps m = ceil(kappa * r) of the r = len(probs) running ones (at least enough for 2 in the
    group; all of them if r <= 2 or m >= r). The kept set, with the finished ones, maximises the
    expected (population) variance of its 0/1 rewards, for independent outcomes:

        m^2 * E[s^2] = (m - 1) * S - S^2 + sum(p_i^2),   S = sum(p_i)

    i.e. a mean near 0.5 (balance likely successes and failures) made of confident predictions.
    Exact search: with the other kept items fixed, the objective is linear in any one item's p,
    so some optimum consists of the i highest and the m - i lowest probabilities. We sort by
    (-p, index) and try every i in m..0; ties keep the earlier i, so equal probabilities keep
    the lowest indices. (m, S and the sums run over the kept running and the finished ones.)
    """
    r, f = len(probs), [float(x) for x in fixed]
    free = max(math.ceil(kappa * r), 2 - len(f))  # running trajectories to keep
    if r <= 2 or free >= r:
        return [True] * r
    order = sorted(range(r), key=lambda j: (-float(probs[j]), j))
    best, best_score = [], -math.inf
    for i in range(free, -1, -1):
        chosen = order[:i] + order[r - free + i:]
        p = [float(probs[j]) for j in chosen] + f
        k, s = len(p), sum(p)
        score = (k - 1) * s - s * s + sum(x * x for x in p)
        if score > best_score + 1e-12:
            best, best_score = chosen, score
    kept = set(best)
    return [j in kept for j in range(r)]


def survival_probabilities(probs: Sequence[float], kappa: float, fixed: Sequence[float] = (), rho: float = 0.5,
                           balance: float = 8.0, s_min: float = 0.1, s_max: float = 0.9) -> np.ndarray:
    """The paper's survival probabilities (A.4, Eq. 2) of the running trajectories: see the
    module docstring. Their mean is kappa (bisection on the bias), each in [s_min, s_max]."""
    p = np.asarray(probs, dtype=np.float64)
    if not len(p):
        return p
    pbar = float(np.mean(np.concatenate([p, np.asarray(fixed, dtype=np.float64)])))
    slope = -balance * (pbar - rho) * (p - rho)
    lo, hi = s_min - slope.max() - 1.0, s_max - slope.min() + 1.0
    for _ in range(100):  # mean(clip(beta + slope)) is non-decreasing in beta
        beta = (lo + hi) / 2
        if np.clip(beta + slope, s_min, s_max).mean() < kappa:
            lo = beta
        else:
            hi = beta
    return np.clip((lo + hi) / 2 + slope, s_min, s_max)


def keep_survival(probs: Sequence[float], kappa: float, rng: np.random.Generator, fixed: Sequence[float] = (),
                  min_group: int = 2, **survival_kwargs) -> list[bool]:
    """The `survival` rule: one Bernoulli draw per running trajectory with its survival
    probability; if fewer than `min_group` of the group would stay (finished ones included), the
    most likely survivors among the drawn-out are kept back."""
    s = survival_probabilities(probs, kappa, fixed, **survival_kwargs)
    kept = list(rng.random(len(s)) < s)
    short = min_group - len(fixed) - sum(kept)
    for j in sorted((j for j in range(len(s)) if not kept[j]), key=lambda j: (-s[j], j))[: max(0, short)]:
        kept[j] = True
    return kept


class QualityHead(nn.Module):
    """Success logit from a detached hidden state: standardise -> Linear -> ReLU -> Linear."""

    def __init__(self, hidden_size: int, width: int = 256):
        super().__init__()
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("std", torch.ones(hidden_size))
        self.mlp = nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp((x - self.mean) / self.std).squeeze(-1)


class HistogramCalibrator:
    """Online binned calibration (paper A.4): equal-width bins on [0, 1] of the sigmoid score,
    Laplace-smoothed class-conditional likelihoods per bin, posterior by Bayes' rule with the
    buffer's prior. With no labelled rows yet it returns the score itself."""

    def __init__(self, bins: int = 10, alpha: float = 1.0):
        self.bins, self.alpha = bins, float(alpha)
        self.positives = [0.0] * bins
        self.negatives = [0.0] * bins

    def _bin(self, raw: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(raw, dtype=np.float64) * self.bins).astype(int), 0, self.bins - 1)

    def fit(self, raw: Sequence[float], outcomes: Sequence[float]) -> None:
        b = self._bin(np.asarray(raw))
        y = (np.asarray(outcomes, dtype=np.float64) > 0).astype(np.float64)
        self.positives = np.bincount(b, weights=y, minlength=self.bins).tolist()
        self.negatives = np.bincount(b, weights=1.0 - y, minlength=self.bins).tolist()

    def __call__(self, raw: Sequence[float]) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.float64)
        pos, neg = np.asarray(self.positives), np.asarray(self.negatives)
        n_pos, n_neg = pos.sum(), neg.sum()
        if n_pos + n_neg == 0:
            return raw
        a, M = self.alpha, self.bins
        b = self._bin(raw)
        like_pos = (pos[b] + a) / (n_pos + a * M)
        like_neg = (neg[b] + a) / (n_neg + a * M)
        prior = n_pos / (n_pos + n_neg)
        return prior * like_pos / (prior * like_pos + (1 - prior) * like_neg)

    def state_dict(self) -> dict:
        return {"bins": self.bins, "alpha": self.alpha, "positives": list(self.positives), "negatives": list(self.negatives)}

    def load_state_dict(self, state: dict) -> None:
        self.bins, self.alpha = state["bins"], state.get("alpha", 1.0)
        if "positives" in state:
            self.positives, self.negatives = list(state["positives"]), list(state["negatives"])
        else:  # a checkpoint of the earlier calibrator: counts and successes per bin
            self.positives = list(state["successes"])
            self.negatives = [c - w for c, w in zip(state["counts"], state["successes"])]


def _check(ok: bool, what: str, value) -> None:
    if not ok:
        raise UserError(f"arrol: {what}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Arrol:
    """The `step` stage: at env step K, prune trajectories inside surviving groups.

    Caller protocol per iteration: `should_prune(iteration)`; if so, for each group at step K,
    `predict(features)` -> `keep(probs)` -> stop the pruned trajectories and `record_prune(...)`;
    at the end, `observe_features(features, rewards)` for the trajectories that finished (their
    step-K features and final rewards), then `observe(groups)` closes the iteration. `stats()`
    reports the iteration last closed by `observe` (or the open one, before it).
    """

    name = "arrol"
    point = "step"

    def __init__(self, hidden_size: int, K: int = 10, kappa: float = 0.5, cold_start: int = 20,
                 bins: int = 10, lr: float = 1e-3, seed: int = 0, *, width: int = 256,
                 buffer_size: int = 4096, train_steps: int = 16, batch_size: int = 256, rule: str = "survival",
                 balance: float = 8.0, s_min: float = 0.1, s_max: float = 0.9, rho: float = 0.5):
        _check(_is_int(hidden_size) and hidden_size >= 1, "hidden_size must be an integer >= 1", hidden_size)
        _check(_is_int(K) and K >= 1, "K must be an integer >= 1", K)
        _check(isinstance(kappa, (int, float)) and 0 < kappa <= 1, "kappa must be in (0, 1]", kappa)
        _check(_is_int(cold_start) and cold_start >= 0, "cold_start must be an integer >= 0", cold_start)
        _check(_is_int(bins) and bins >= 1, "bins must be an integer >= 1", bins)
        _check(isinstance(lr, (int, float)) and lr > 0, "lr must be > 0", lr)
        _check(_is_int(seed), "seed must be an integer", seed)
        for key, v in (("width", width), ("buffer_size", buffer_size), ("train_steps", train_steps),
                       ("batch_size", batch_size)):
            _check(_is_int(v) and v >= 1, f"{key} must be an integer >= 1", v)
        _check(rule in RULES, f"rule must be one of {', '.join(RULES)}", rule)
        _check(isinstance(s_min, (int, float)) and isinstance(s_max, (int, float)) and 0 < s_min <= kappa <= s_max <= 1,
               f"need 0 < s_min <= kappa={kappa} <= s_max <= 1 (s_min, s_max)", (s_min, s_max))
        _check(isinstance(balance, (int, float)) and balance >= 0, "balance must be >= 0", balance)
        _check(isinstance(rho, (int, float)) and 0 <= rho <= 1, "rho must be in [0, 1]", rho)
        self.rule, self.survival = rule, dict(balance=float(balance), s_min=float(s_min), s_max=float(s_max), rho=float(rho))
        self.rng = np.random.default_rng(seed)  # the survival draws (saved in checkpoints)
        self.hidden_size, self.K, self.kappa, self.cold_start = hidden_size, K, float(kappa), cold_start
        self.lr, self.seed, self.width = float(lr), seed, width
        self.buffer_size, self.train_steps, self.batch_size = buffer_size, train_steps, batch_size
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            torch.manual_seed(seed)
            self.head = QualityHead(hidden_size, width)
        self.opt = torch.optim.Adam(self.head.parameters(), lr=self.lr)
        self.calibrator = HistogramCalibrator(bins)
        self.features = torch.zeros(0, hidden_size)
        self.rewards = torch.zeros(0)
        self.iteration = 0  # iterations closed by observe()
        self.updates = 0  # observe_features calls that trained the head
        self.last_brier: float | None = None
        self._stats, self._closed = StageStats(), False

    # ------------------------------------------------------------------ decisions
    def should_prune(self, iteration: int | None = None) -> bool:
        """False during the first `cold_start` iterations (default: the iterations observed)."""
        self._open()
        return (self.iteration if iteration is None else iteration) >= self.cold_start

    def keep(self, probs: Sequence[float], kappa: float | None = None, fixed: Sequence[float] = ()) -> list[bool]:
        """Which running trajectories stay; `fixed`: real outcomes of the group's finished ones."""
        kappa = self.kappa if kappa is None else kappa
        if self.rule == "deterministic":
            return keep(probs, kappa, fixed)
        return keep_survival(probs, kappa, self.rng, fixed, **self.survival)

    @torch.no_grad()
    def raw_probs(self, features: torch.Tensor) -> np.ndarray:
        self.head.eval()
        return torch.sigmoid(self.head(self._rows(features))).double().numpy()

    def predict(self, features: torch.Tensor) -> np.ndarray:
        """Calibrated success probabilities, [n]."""
        return self.calibrator(self.raw_probs(features))

    # ------------------------------------------------------------------ learning
    def observe_features(self, features: torch.Tensor, rewards: Sequence[float]) -> None:
        """Add (step-K features, final reward) rows to the replay buffer, score the batch before
        training on it (Brier score), take `train_steps` Adam steps, refit the calibration."""
        self._open()
        x, y = self._rows(features), torch.as_tensor(list(rewards), dtype=torch.float32)
        if len(x) != len(y):
            raise ValueError(f"arrol: {len(x)} feature rows but {len(y)} rewards")
        if not len(x):
            return
        self.last_brier = float(np.mean((self.predict(x) - y.double().numpy()) ** 2))
        self.features = torch.cat([self.features, x])[-self.buffer_size:]
        self.rewards = torch.cat([self.rewards, y])[-self.buffer_size:]
        self.head.mean.copy_(self.features.mean(0))
        self.head.std.copy_(self.features.std(0, unbiased=False).clamp_min(1e-6))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.updates)  # resumable
        loss_fn = nn.BCEWithLogitsLoss()
        self.head.train()
        for _ in range(self.train_steps):
            n = len(self.features)
            idx = torch.randint(n, (min(self.batch_size, n),), generator=gen)
            loss = loss_fn(self.head(self.features[idx]), self.rewards[idx])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.updates += 1
        self.calibrator.fit(self.raw_probs(self.features), self.rewards.tolist())

    def observe(self, groups: list) -> None:
        """Close the iteration (the head is trained by `observe_features`, which needs the
        step-K features the groups do not carry)."""
        self._open()
        self.iteration += 1
        self._closed = True

    # ------------------------------------------------------------------ accounting
    def record_prune(self, n_pruned: int, tokens_generated_by_pruned: int, est_tokens_avoided: int) -> None:
        """One group's pruning: its pruned trajectories, their generated step tokens (now kept
        out of the loss) and the estimated step tokens they would have generated."""
        self._open()
        if n_pruned <= 0:
            return
        d = self._stats.decisions
        d["trajectories_pruned"] = d.get("trajectories_pruned", 0) + n_pruned
        d["groups_pruned"] = d.get("groups_pruned", 0) + 1
        self._stats.step_tokens_generated += tokens_generated_by_pruned
        self._stats.step_tokens_excluded += tokens_generated_by_pruned
        self._stats.step_tokens_avoided += est_tokens_avoided

    def stats(self) -> StageStats:
        s = self._stats
        extra = {"buffer_rows": len(self.rewards)}
        if self.last_brier is not None:
            extra["brier"] = round(self.last_brier, 6)
        return StageStats(decisions={"trajectories_pruned": 0, "groups_pruned": 0, **s.decisions},
                          step_tokens_generated=s.step_tokens_generated,
                          step_tokens_excluded=s.step_tokens_excluded,
                          step_tokens_avoided=s.step_tokens_avoided, extra=extra)

    def _open(self) -> None:
        """The first call of a new iteration resets its accounting."""
        if self._closed:
            self._stats, self._closed, self.last_brier = StageStats(), False, None

    def _rows(self, features) -> torch.Tensor:
        x = torch.as_tensor(features).detach().to("cpu", torch.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"arrol: features must be [n, {self.hidden_size}], got {list(x.shape)}")
        return x

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Tensors under "head" (weights, feature standardisation) and "buffer" (replay rows);
        the rest is JSON. Adam's moments are not saved (a fresh Adam on load)."""
        return {
            "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
            "buffer": {"features": self.features.clone(), "rewards": self.rewards.clone()},
            "calibration": self.calibrator.state_dict(),
            "hidden_size": self.hidden_size, "iteration": self.iteration, "updates": self.updates,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["hidden_size"] != self.hidden_size:
            raise UserError(f"arrol: checkpoint head has hidden_size {state['hidden_size']}, "
                            f"the model has {self.hidden_size}")
        self.head.load_state_dict(state["head"])
        self.opt = torch.optim.Adam(self.head.parameters(), lr=self.lr)
        self.features = state["buffer"]["features"].to(torch.float32).clone()
        self.rewards = state["buffer"]["rewards"].to(torch.float32).clone()
        self.calibrator.load_state_dict(state["calibration"])
        self.iteration, self.updates = int(state["iteration"]), int(state["updates"])
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self._stats, self._closed, self.last_brier = StageStats(), False, None
