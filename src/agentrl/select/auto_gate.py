"""`--gate K,auto`: the gate's threshold d_L fitted online, for the model in hand.

Every group the gate looks at (one still running at step K) becomes a labelled example once it
ends: its score at K (d_K, or the signal of `K,auto:SIGNAL`) and whether its G rewards were all
equal (zero variance: the group a cut should remove). Groups the gate cut have no label (they
never ended), so the labels are a biased sample: below the threshold in force only the audited
share a of the groups ran on. Each label therefore carries an inverse-probability weight
(Horvitz-Thompson): 1 for a group that ran on because the gate did not fire, 1/a for an audited
one, which stands for itself and the (1 - a)/a groups that were cut in its place. Weighted sums
over any score interval are then unbiased for what all groups there would have shown; with the
audited groups unweighted, the region below the threshold is under-counted a times and the
precision of a wider cut is read off the groups just above it.

The fit, after each iteration (or `agentrl rollout` round): among the cuts "score < t" (t between
two observed scores) that rest on at least 5 labelled groups, the one that removes the most
zero-variance groups (weighted) while its weighted precision (share of removed groups that are
zero-variance) is at least `gate.precision` (0.8 by default, the paper's safe point). Before `gate.min_labels` labelled
groups, or when no cut reaches the precision, d_L = 0: nothing is cut (and nothing audited, so
every group keeps being labelled). `gate.window` keeps only the labels of the last W iterations
(the policy moves; 0 = all). `gate.warmup` seeds the labels from a groups table (groups.csv of
an ungated `agentrl rollout` with the same K); those rows count as iteration 0.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from agentrl.errors import UserError
from agentrl.select.gate_rule import GateLabel, threshold_fires
from agentrl.specs import SIGNAL_NAMES, convergence_score, gate_text
from agentrl.stats import wilson


@dataclass(frozen=True)
class Label:
    iteration: int
    score: float  # the gate's score at K (lower = more converged)
    zero: bool  # its final rewards were all equal
    weight: float  # inverse probability of being labelled: 1 (not fired) or 1/a (audited)


@dataclass(frozen=True)
class Fit:
    d_L: float  # 0: cut nothing
    labelled: int  # labels the fit used
    precision: float | None  # weighted share of zero-variance groups below d_L (None: no cut)
    cut_share: float  # weighted share of the labelled groups below d_L


MIN_SUPPORT = 5  # labelled groups a cut must rest on: one lucky zero-variance group is not a precision of 1


def fit_threshold(labels: list[Label], precision: float, min_labels: int, min_support: int = MIN_SUPPORT) -> Fit:
    """The threshold removing the most zero-variance groups (weighted) at weighted precision >=
    `precision`, among cuts with at least `min_support` labelled groups below them."""
    n = len(labels)
    if n < max(1, min_labels):
        return Fit(0.0, n, None, 0.0)
    order = np.argsort([lb.score for lb in labels], kind="stable")
    score = np.array([labels[i].score for i in order])
    w = np.array([labels[i].weight for i in order])
    zero = np.array([labels[i].zero for i in order], dtype=float)
    values = np.unique(score)  # sorted distinct scores; a cut below t takes every label up to the last <= v
    last = np.searchsorted(score, values, side="right") - 1
    below_w, below_wz, support = np.cumsum(w)[last], np.cumsum(w * zero)[last], last + 1
    ok = (below_wz / below_w >= precision - 1e-12) & (support >= min_support)
    if not ok.any():
        return Fit(0.0, n, None, 0.0)
    # the most zero-variance groups removed; on a tie the narrower cut
    j = int(np.flatnonzero(ok)[np.argmax(below_wz[ok])])
    t = (values[j] + values[j + 1]) / 2 if j + 1 < len(values) else min(1.0, values[j] + 1e-3)
    return Fit(float(t), n, float(below_wz[j] / below_w[j]), float(below_w[j] / w.sum()))


def recent(items: list, iteration: int, window: int, key) -> list:
    """The items of the last `window` iterations up to `iteration` (`key`: an item's iteration; window 0: all)."""
    return [x for x in items if not window or key(x) > iteration - window]


def audit_report(audits: list[tuple[int, bool]]) -> dict:
    """The audit's live precision: the share of audited would-cut groups (iteration, ended
    zero-variance) that ended zero-variance, with its 95% Wilson interval."""
    zero = sum(z for _, z in audits)
    ci = wilson(zero, len(audits))
    return {"audited": len(audits), "precision_audit": round(zero / len(audits), 4) if audits else None,
            "precision_audit_ci95": [round(ci[0], 4), round(ci[1], 4)] if ci else None}


class AutoThreshold:
    """The labels seen so far and the threshold fitted on them (state saved in checkpoints)."""

    def __init__(self, signal: str, precision: float = 0.8, min_labels: int = 24, window: int = 0,
                 warmup: list[Label] | None = None):
        self.signal, self.precision, self.min_labels, self.window = signal, precision, min_labels, window
        self.labels: list[Label] = list(warmup or [])
        self.audits: list[tuple[int, bool]] = []  # (iteration, ended zero-variance) of each audited group
        self.fit = Fit(0.0, 0, None, 0.0)
        self.refit(0)

    def score(self, signals: Mapping[str, float]) -> float:
        return convergence_score(self.signal, signals)

    def add(self, iteration: int, score: float, zero: bool, audited: bool, audit_rate: float) -> None:
        weight = 1.0 / audit_rate if audited else 1.0
        self.labels.append(Label(iteration, float(score), bool(zero), weight))
        if audited:
            self.audits.append((iteration, bool(zero)))

    def refit(self, iteration: int) -> Fit:
        """Fit on the labels of the window ending at `iteration` (the next iteration uses it)."""
        self.fit = fit_threshold(recent(self.labels, iteration, self.window, lambda lb: lb.iteration), self.precision,
                                 self.min_labels)
        self._at = iteration
        return self.fit

    def report(self) -> dict:
        """What metrics, the console and TensorBoard show: the d_L in force, the labels behind it,
        its fitted precision and the audit's live precision (share of audited would-cut groups that
        ended zero-variance, over the window) with its 95% Wilson interval."""
        return {"d_L": round(self.fit.d_L, 6), "labelled": self.fit.labelled,
                "precision_fit": None if self.fit.precision is None else round(self.fit.precision, 4),
                "cut_share_fit": round(self.fit.cut_share, 4),
                **audit_report(recent(self.audits, self._at, self.window, lambda a: a[0]))}

    def state_dict(self) -> dict:
        return {"labels": [asdict(lb) for lb in self.labels], "audits": [list(a) for a in self.audits],
                "at": self._at}

    def load_state_dict(self, state: dict) -> None:
        self.labels = [Label(**lb) for lb in state.get("labels", [])]
        self.audits = [(int(i), bool(z)) for i, z in state.get("audits", [])]
        self.refit(state.get("at", 0))


class FittedThreshold:
    """`--gate K,auto[:SIGNAL]` as a `GateRule`: the threshold rule with d_L re-fitted after each
    iteration on the labels so far (`learn`); d_L = 0 (cut nothing) until a fit reaches the
    precision. Its state is the labels and audits (checkpointed)."""

    def __init__(self, K: int, signal: str = SIGNAL_NAMES[0], tau_H: float | None = None, precision: float = 0.8,
                 min_labels: int = 24, window: int = 0, warmup: list[Label] | None = None):
        self.K, self.signal, self.tau_H = K, signal, tau_H
        self.threshold = AutoThreshold(signal, precision, min_labels, window, warmup)

    @property
    def d_L(self) -> float:
        """The threshold in force: the latest fit's."""
        return self.threshold.fit.d_L

    def fires(self, signals: Mapping[str, float]) -> bool:
        return threshold_fires(signals, self.signal, self.d_L, self.tau_H)

    def learn(self, iteration: int, labels: Sequence[GateLabel]) -> None:
        for lb in labels:
            self.threshold.add(iteration, self.threshold.score(lb.signals), lb.zero_variance,
                               audited=lb.audited, audit_rate=lb.audit_rate)
        self.threshold.refit(iteration)

    def report(self) -> dict:
        return self.threshold.report()

    def state_dict(self) -> dict:
        return self.threshold.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.threshold.load_state_dict(state)

    def __str__(self) -> str:
        return gate_text(self.K, self.d_L, self.tau_H, auto=True, signal=self.signal)


def read_warmup(path: Path, K: int, signal: str) -> list[Label]:
    """Labels from a groups table (groups.csv): the rows at K of groups that ran to the end."""
    return [Label(0, convergence_score(signal, row), zero, 1.0) for row, zero in read_warmup_rows(path, K, (signal,))]


def read_warmup_rows(path: Path, K: int, signals: Sequence[str]) -> list[tuple[dict[str, float], bool]]:
    """(the `signals` at K, ended zero-variance) of each group of a groups table that ran to the end."""
    if not path.is_file():
        raise UserError(f"gate.warmup: groups table not found: {path}")
    out = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("K", *signals, "rewards") if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"gate.warmup: {path} lacks the columns {', '.join(missing)} (a groups.csv of `agentrl rollout`)")
        for line, row in enumerate(reader, start=2):
            try:
                if int(row["K"]) != K or row.get("cut", "0") not in ("0", "", "False"):
                    continue  # a cut group never ended: no label
                rewards = [float(x) for x in row["rewards"].split(";")]
                values = {s: float(row[s]) for s in signals}
            except (TypeError, ValueError) as e:
                raise UserError(f"gate.warmup: {path}:{line}: bad value ({e})") from None
            if not all(math.isfinite(v) for v in values.values()) or len(rewards) < 2:
                raise UserError(f"gate.warmup: {path}:{line}: bad row")
            out.append((values, len(set(rewards)) == 1))
    if not out:
        raise UserError(f"gate.warmup: {path} has no uncut group at K={K}: record it with --gate off and K in rollout.signal_steps")
    return out


__all__ = ["AutoThreshold", "Fit", "FittedThreshold", "Label", "audit_report", "fit_threshold", "read_warmup",
           "read_warmup_rows", "recent", "wilson"]
