"""The CUT_{K,d_L} gate: after env step K, stop a group whose rollouts have converged.

Fires when d_K < d_L (strictly; d_K == d_L does not fire), or, with the OR-rule, when the
share of the group already finished tau_K >= tau_H. A cut group's trajectories stop at K and
the group is excluded from advantages and loss; its rewards are kept for logging only.
"""

from __future__ import annotations

from agentrl.specs import Gate, parse_gate  # defined at the bottom layer (config parses the spec)

__all__ = ["Gate", "parse_gate"]
