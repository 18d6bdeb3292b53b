"""The CUT_{K,d_L} gate: after env step K, stop a group whose rollouts have converged.

Fires when d_K < d_L (strictly; d_K == d_L does not fire), or, with the OR-rule, when the
share of the group already finished tau_K >= tau_H. A cut group's trajectories stop at K and
the group is excluded from advantages and loss; its rewards are kept for logging only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentrl.errors import UserError

_SPEC = re.compile(r"^\s*(\d+)\s*,\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Gate:
    K: int
    d_L: float
    tau_H: float | None = None  # OR-rule threshold on termination_fraction; None = off

    def __post_init__(self):
        if self.K < 1:
            raise UserError(f"gate K must be >= 1, got {self.K}")
        if not 0.0 <= self.d_L <= 1.0:
            raise UserError(f"gate d_L must be in [0, 1], got {self.d_L}")
        if self.tau_H is not None and not 0.0 <= self.tau_H <= 1.0:
            raise UserError(f"gate tau_H must be in [0, 1], got {self.tau_H}")

    def fires(self, signals: dict[str, float]) -> bool:
        if signals["prefix_edit_distance_mean"] < self.d_L:
            return True
        return self.tau_H is not None and signals["termination_fraction"] >= self.tau_H

    def __str__(self) -> str:
        return f"{self.K},{self.d_L:g}" + (f" or tau>={self.tau_H:g}" if self.tau_H is not None else "")


def parse_gate(spec: str | None, tau_H: float | None = None) -> Gate | None:
    """'K,d_L' -> Gate; 'off' / None -> no gate."""
    if spec is None or spec.strip().lower() in ("off", "none", ""):
        if tau_H is not None:
            raise UserError("--gate-or-tau needs a gate (--gate K,d_L)")
        return None
    m = _SPEC.match(spec)
    if not m:
        raise UserError(f"malformed gate {spec!r}; expected K,d_L (e.g. 10,0.12) or off")
    return Gate(int(m.group(1)), float(m.group(2)), tau_H)
