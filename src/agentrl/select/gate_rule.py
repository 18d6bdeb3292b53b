"""The gate's decision: a `GateRule` says, from a group's signals at step K, whether to cut it.

CUT_{K,d_L} (`Threshold`): after env step K, stop a group whose rollouts have converged. It
fires when its signal's score is below d_L (d_K < d_L by default; strictly: d_K == d_L does not
fire), or, with the OR-rule, when the share of the group already finished tau_K >= tau_H. A cut
group's trajectories stop at K and the group is excluded from advantages and loss; its rewards
are kept for logging only. `--gate K,auto` is the same threshold with d_L fitted online
(`agentrl.select.auto_gate.FittedThreshold`); a learned classifier over several signals is a
third rule with its own state; `--gate K,nowin` (`NoWin`) cuts a group none of whose rows has
ended by K, the all-fail rule of a policy whose failing rows wander. The CUT stage (`agentrl.select.cut`) asks the rule and feeds it
labels; it never looks inside one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentrl.specs import SIGNAL_NAMES, convergence_score, gate_text


@dataclass(frozen=True)
class GateLabel:
    """One group the gate looked at (still running at K) that ran to the end: what it looked like
    at K and how it ended, so a rule that learns can learn from it."""

    signals: Mapping[str, float]  # the group's signals at K (rollout.signals)
    zero_variance: bool  # its G final rewards were all equal: the group a cut should remove
    audited: bool  # the rule fired, and the audit let it run on anyway (else: the rule did not fire)
    audit_rate: float  # the share of fired groups the audit lets run (select.gate_audit)


@runtime_checkable
class GateRule(Protocol):
    """The contract every gate rule keeps:

    - `K`: the env step after which it decides (the stage calls `fires` only then).
    - `fires(signals)`: True = cut the group. `signals` holds the signals at K
      (`agentrl.rollout.signals.SIGNALS`); the answer depends on them and on the rule's state
      only (no randomness: the audit's draw is the stage's), so equal inputs, equal answers.
    - `learn(iteration, labels)`: called once after each iteration (or `agentrl rollout` round)
      with the labelled groups of that iteration (possibly none); a rule that learns updates
      itself here and the next iteration decides with what it learned. A fixed rule ignores it.
    - `report()`: what it shows per iteration (metrics `stages.cut.extra.auto`), None for a rule
      with nothing to report.
    - `state_dict()` / `load_state_dict(state)`: JSON-safe; a fresh rule built from the same spec
      and loaded with the state decides as the saved one would (checkpoint and resume). A rule
      without state returns {}.
    - `str(rule)`: how it reads in reports and on the console.
    """

    K: int

    def fires(self, signals: Mapping[str, float]) -> bool: ...

    def learn(self, iteration: int, labels: Sequence[GateLabel]) -> None: ...

    def report(self) -> dict | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def threshold_fires(signals: Mapping[str, float], signal: str, d_L: float, tau_H: float | None) -> bool:
    """score(signal) < d_L, strictly; or, with the OR-rule, termination_fraction >= tau_H."""
    if convergence_score(signal, signals) < d_L:
        return True
    return tau_H is not None and signals["termination_fraction"] >= tau_H


class FixedRule:
    """What a rule that never learns shares: no learning, nothing to report, no state."""

    def learn(self, iteration: int, labels: Sequence[GateLabel]) -> None:
        pass  # fixed: nothing to learn

    def report(self) -> dict | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class Threshold(FixedRule):
    """`--gate K,d_L`: CUT_{K,d_L}, fixed (d_K by default; plus the OR-rule when tau_H is set)."""

    K: int
    d_L: float
    tau_H: float | None = None
    signal: str = SIGNAL_NAMES[0]

    def fires(self, signals: Mapping[str, float]) -> bool:
        return threshold_fires(signals, self.signal, self.d_L, self.tau_H)

    def __str__(self) -> str:
        return gate_text(self.K, self.d_L, self.tau_H)


@dataclass(frozen=True)
class NoWin(FixedRule):
    """`--gate K,nowin`: cut a group none of whose rows has ended by step K. In ALFWorld an episode
    ends before T_max only by winning, so the group has no win yet; on a policy that rarely wins
    late such a group is all-fail (measured on 200 groups of the 120-game warm start: precision
    0.93 at K 10, 0.49 at K 5; docs/gate.md). The classifier gate's guard, as a rule of its own:
    nothing to fit, no labels needed. Fixed: no state."""

    K: int

    def fires(self, signals: Mapping[str, float]) -> bool:
        return signals["termination_fraction"] == 0

    def __str__(self) -> str:
        return f"{self.K},nowin"
