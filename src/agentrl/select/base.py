"""Rollout selection: one protocol for every way of not paying for rollouts without signal.

A stage acts at one point of an iteration:

- ``before``  which tasks to roll out (GRESO skips tasks whose recent groups were all-equal;
  Pilot-Commit allocates trajectories after a pilot);
- ``step``    during the rollout, right after env step K (the CUT gate stops a group; ARRoL
  prunes trajectories inside a group);
- ``after``   which groups enter the loss (the DAPO filter).

Every stage keeps the same accounting per iteration (`StageStats`), sees the iteration's final
outcome (`observe`, where GRESO updates its streaks and ARRoL trains its head), and saves its
state in the run's checkpoints (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

from agentrl.errors import UserError

POINTS = ("before", "step", "after")


@dataclass
class StageStats:
    """One stage's accounting for one iteration (metrics.jsonl: `stages.<name>`)."""

    decisions: dict[str, int] = field(default_factory=dict)  # e.g. tasks_skipped, groups_cut, trajectories_pruned
    step_tokens_generated: int = 0  # by the trajectories this stage decided on
    step_tokens_excluded: int = 0  # generated, then kept out of the loss by this stage
    step_tokens_avoided: int = 0  # estimate: tokens not generated because of this stage
    precision: float | None = None  # share of its decisions the ground truth agrees with, where known
    extra: dict = field(default_factory=dict)  # stage-specific (e.g. GRESO's p, the audit's recall)

    def row(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in ({}, None)}


@runtime_checkable
class Stage(Protocol):
    name: str
    point: str  # one of POINTS

    def observe(self, groups: list) -> None:
        """The iteration's groups with their final rewards (after the update)."""

    def stats(self) -> StageStats:
        """This iteration's accounting (reset at the next iteration)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def settings_check(stage: str):
    """`check(ok, message)` for a stage's settings: a one-line UserError naming the stage."""
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise UserError(f"{stage}: {message}")

    return check


def finite_number(x) -> bool:
    """A real number setting (not a bool, not NaN or infinite)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
