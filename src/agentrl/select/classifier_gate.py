"""`--gate K,auto:SIG1+SIG2+...`: a gate on several signals, a small classifier fitted online.

One signal misses what another carries (issue 49: on the 120-game warm start d_K ranks all-fail
groups worse than chance while the observations' spread carries them), so this rule reads
several. Each group the gate looked at becomes a labelled example once it ends, exactly as for
`K,auto` (select/auto_gate.py): its signals at K, whether its G rewards were all equal, and an
inverse-probability weight (1, or 1/a for an audited group, which stands for the cut ones).

The fit, after each iteration (or `agentrl rollout` round), on the labels of the window:
1. an L2-regularised logistic regression of "zero variance" on the standardised signals,
   weighted, minimised with scipy (L-BFGS; deterministic);
2. cross-fitting: each label's probability comes from a model fitted on the other folds, so the
   cut is chosen on scores the labels did not shape (a cut chosen on the labels it was fitted on
   overstates its precision);
3. the cut on those held-out scores, by the threshold fit of `K,auto` (`fit_threshold`: the most
   zero-variance groups removed at weighted precision >= `gate.precision`, resting on at least 5
   labels); the model fitted on all labels then decides with that cut;
4. the guard: the same cut fitted again with every group in which a row had ended by K spared
   (in ALFWorld a row ends before T_max only by winning, so such a group is not all-fail); where
   it removes at least as many zero-variance groups at the floor, the guard holds and such groups
   are never cut. A linear score cannot say "any win spares the group": on the 120-game warm
   start 12 of the 17 informative groups the cross-fitted cut took at K 10 had a win by then, and
   the guarded cut took 76 zero-variance groups of 82 (precision 0.93) where the plain one took
   71 of 88 (0.81) (200 groups, docs/measurements/auto-gate-and-tier1.md). Where all-success groups
   are common (they end early and win) the plain cut removes more, and the guard stays off.
Before `gate.min_labels` labels, with one class only, or when no cut reaches the precision,
nothing is cut (so every group keeps being labelled). Its state is the examples and audits; a
fresh rule loaded with them refits to the same model (checkpoint and resume).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy.optimize import minimize

from agentrl.select.auto_gate import Fit, Label, audit_report, fit_threshold, recent
from agentrl.select.gate_rule import GateLabel
from agentrl.specs import gate_text

FOLDS = 5  # cross-fitting folds
L2 = 1.0  # ridge on the standardised coefficients (the intercept is not penalised)


@dataclass(frozen=True)
class Example:
    iteration: int
    x: tuple[float, ...]  # the rule's signals at K, in its order
    zero: bool  # its final rewards were all equal
    weight: float  # 1 (the gate did not fire) or 1/a (audited)
    ended: bool = False  # a row had ended by K (termination_fraction > 0; in ALFWorld: won)


@dataclass(frozen=True)
class Logistic:
    """P(zero variance | x) = sigmoid(intercept + coef . (x - mean) / scale)."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[float, ...]
    intercept: float

    def p(self, X: np.ndarray) -> np.ndarray:
        z = self.intercept + ((X - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.coef)
        return 1.0 / (1.0 + np.exp(-z))


def fit_logistic(X: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float = L2) -> Logistic:
    """Weighted L2-regularised logistic regression on standardised features."""
    mean = np.average(X, axis=0, weights=w)
    scale = np.sqrt(np.average((X - mean) ** 2, axis=0, weights=w))
    scale = np.where(scale > 1e-9, scale, 1.0)  # a constant signal carries nothing: coefficient ~0
    Z = (X - mean) / scale
    W = w / w.sum() * len(w)  # weights summing to n: the ridge means the same at any audit rate

    def loss(theta):
        b, c = theta[0], theta[1:]
        z = b + Z @ c
        # log(1 + e^z) - y z, stably; gradient (sigmoid(z) - y)
        nll = np.sum(W * (np.logaddexp(0.0, z) - y * z)) + 0.5 * l2 * c @ c
        r = W * (1.0 / (1.0 + np.exp(-z)) - y)
        return nll, np.concatenate([[r.sum()], Z.T @ r + l2 * c])

    theta = minimize(loss, np.zeros(X.shape[1] + 1), jac=True, method="L-BFGS-B").x
    return Logistic(tuple(mean.tolist()), tuple(scale.tolist()), tuple(theta[1:].tolist()), float(theta[0]))


def cross_fitted(X: np.ndarray, y: np.ndarray, w: np.ndarray, folds: int = FOLDS) -> np.ndarray:
    """Each example's P(zero) from a model fitted without its fold (fold = index mod `folds`)."""
    fold = np.arange(len(y)) % folds
    p = np.empty(len(y))
    for k in range(folds):
        train, held = fold != k, fold == k
        if not held.any():
            continue
        if len(set(y[train].tolist())) < 2:  # one class left: the base rate
            p[held] = np.average(y[train], weights=w[train])
        else:
            p[held] = fit_logistic(X[train], y[train], w[train]).p(X[held])
    return p


def row_ended(signals: Mapping):
    """A row of the group had ended by K (in ALFWorld, before T_max only by winning): the guard spares
    it. Scalars give a bool, arrays of groups (analyze) one per group."""
    return signals["termination_fraction"] > 0


def removed(fit: Fit) -> float:
    """The weighted share of the labelled groups a fit's cut removes that are zero-variance."""
    return 0.0 if fit.precision is None else fit.precision * fit.cut_share


class ClassifierGate:
    """`--gate K,auto:SIG1+SIG2...` as a `GateRule` (see the module docstring)."""

    def __init__(self, K: int, signals: Sequence[str], tau_H: float | None = None, precision: float = 0.8,
                 min_labels: int = 24, window: int = 0, warmup: list[Example] | None = None):
        self.K, self.signals, self.tau_H = K, tuple(signals), tau_H
        self.precision, self.min_labels, self.window = precision, min_labels, window
        self.examples: list[Example] = list(warmup or [])
        self.audits: list[tuple[int, bool]] = []
        self.refit(0)

    def _x(self, signals: Mapping[str, float]) -> tuple[float, ...]:
        return tuple(float(signals[s]) for s in self.signals)

    @property
    def d_L(self) -> float:
        """The cut in force on 1 - P(zero variance) (0: cut nothing)."""
        return self.fit.d_L

    def fires(self, signals: Mapping[str, float]) -> bool:
        spared = self.guard and row_ended(signals)
        if self.model is not None and not spared and 1.0 - float(self.model.p(np.array([self._x(signals)]))[0]) < self.fit.d_L:
            return True  # (a model exists only with a cut: d_L > 0)
        return self.tau_H is not None and signals["termination_fraction"] >= self.tau_H

    def learn(self, iteration: int, labels: Sequence[GateLabel]) -> None:
        for lb in labels:
            self.examples.append(Example(iteration, self._x(lb.signals), bool(lb.zero_variance),
                                         1.0 / lb.audit_rate if lb.audited else 1.0,
                                         row_ended(lb.signals)))
            if lb.audited:
                self.audits.append((iteration, bool(lb.zero_variance)))
        self.refit(iteration)

    def refit(self, iteration: int) -> None:
        self._at = iteration
        ex = recent(self.examples, iteration, self.window, lambda e: e.iteration)
        self.model, self.fit, self.guard = None, Fit(0.0, len(ex), None, 0.0), False
        y = np.array([e.zero for e in ex], dtype=float)
        if len(ex) < max(1, self.min_labels) or len(set(y.tolist())) < 2:
            return
        X, w = np.array([e.x for e in ex]), np.array([e.weight for e in ex])
        held_out = cross_fitted(X, y, w)
        plain = fit_threshold([Label(e.iteration, float(1.0 - p), e.zero, e.weight) for e, p in zip(ex, held_out)],
                              self.precision, self.min_labels)
        # the guard's variant: a spared group scores above any cut (2 > every 1 - p)
        guarded = fit_threshold([Label(e.iteration, 2.0 if e.ended else float(1.0 - p), e.zero, e.weight)
                                 for e, p in zip(ex, held_out)], self.precision, self.min_labels)
        guarded = replace(guarded, d_L=min(guarded.d_L, 1.0))  # past the last unspared score: cut them all
        self.guard = guarded.d_L > 0 and removed(guarded) >= removed(plain)
        self.fit = guarded if self.guard else plain
        if self.fit.d_L > 0:
            self.model = fit_logistic(X, y, w)

    def report(self) -> dict:
        """The cut in force (on P(zero variance): cut above `p_cut`), the standardised
        coefficients, the cross-fitted precision and share, and the audit's live precision."""
        coef = dict(zip(self.signals, (round(c, 4) for c in self.model.coef))) if self.model else None
        return {"signals": list(self.signals), "coef": coef, "p_cut": round(1.0 - self.fit.d_L, 6) if self.model else None,
                "guard": self.guard,
                "labelled": self.fit.labelled,
                "precision_fit": None if self.fit.precision is None else round(self.fit.precision, 4),
                "cut_share_fit": round(self.fit.cut_share, 4),
                **audit_report(recent(self.audits, self._at, self.window, lambda a: a[0]))}

    def state_dict(self) -> dict:
        return {"examples": [asdict(e) | {"x": list(e.x)} for e in self.examples],
                "audits": [list(a) for a in self.audits], "at": self._at}

    def load_state_dict(self, state: dict) -> None:
        self.examples = [Example(int(e["iteration"]), tuple(e["x"]), bool(e["zero"]), float(e["weight"]),
                                 bool(e.get("ended", False)))  # a checkpoint from before the guard: none ended
                         for e in state.get("examples", [])]
        self.audits = [(int(i), bool(z)) for i, z in state.get("audits", [])]
        self.refit(state.get("at", 0))

    def __str__(self) -> str:
        return gate_text(self.K, self.d_L, self.tau_H, auto=True, signal="+".join(self.signals))
