"""Pilot-Commit: a cheap pilot decides which tasks get the rest of their group.

After Pilot-Commit (seed paper 004). Per iteration, with B tasks and G trajectories a task:

1. pilot: roll out n_p trajectories on each of pilot_factor x B tasks (`pilot_tasks`);
2. bin each task by its pilot success rate s (`decide`):
   - s < low              deferred: not trained now, stays in the pool;
   - low <= s <= high     qualifies; at most B are committed, those with s closest to 0.5
                          (ties by pilot order), the others are skipped this iteration;
   - s > high             skipped this iteration;
   - s == 1.0             also evicted: never piloted again in this run;
   - cut by a gate        deferred (no final label);
3. commit: roll out the remaining G - n_p trajectories of each committed task and train on its
   pilot + commit trajectories.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.select.base import StageStats


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"pilot-commit: {message}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Decision:
    commit: list[Game] = field(default_factory=list)
    deferred: list[Game] = field(default_factory=list)
    skipped: list[Game] = field(default_factory=list)  # includes the evicted ones
    evicted: list[Game] = field(default_factory=list)  # newly evicted this iteration


class PilotCommit:
    """Pilot, then commit; see the module docstring for the rule."""

    name = "pilot-commit"
    point = "before"

    def __init__(self, n_p: int = 2, pilot_factor: float = 3, low: float = 0.125, high: float = 0.75,
                 group_size: int | None = None):
        _check(isinstance(n_p, int) and not isinstance(n_p, bool) and n_p >= 1, f"n_p must be an integer >= 1, got {n_p!r}")
        if group_size is not None:
            _check(n_p < group_size, f"n_p must be < the group size G={group_size}, got {n_p}")
        _check(_number(pilot_factor) and pilot_factor >= 1, f"pilot_factor must be >= 1, got {pilot_factor!r}")
        _check(_number(low) and _number(high) and 0 <= low < high <= 1,
               f"need 0 <= low < high <= 1, got low={low!r} high={high!r}")
        self.n_p, self.pilot_factor, self.low, self.high = n_p, pilot_factor, float(low), float(high)
        self.group_size = group_size  # G; only for the tokens-avoided estimate
        self.evicted: set[str] = set()
        self.B = 0
        self._stats = StageStats()

    def is_evicted(self, game_id: str) -> bool:
        return game_id in self.evicted

    def pilot_tasks(self, candidates: Iterable[Game], B: int) -> list[Game]:
        """The first ceil(pilot_factor x B) distinct candidates not evicted. Starts a new iteration."""
        self.B = B
        self._stats = StageStats()
        n = math.ceil(self.pilot_factor * B)
        out: list[Game] = []
        seen: set[str] = set()
        for game in candidates:
            if len(out) >= n:
                break
            if game.game_id in self.evicted or game.game_id in seen:
                continue
            out.append(game)
            seen.add(game.game_id)
        return out

    def decide(self, pilot_groups: list) -> Decision:
        """Bin the pilot groups (B from the last `pilot_tasks` call) and update the evicted set."""
        d = Decision()
        qualify: list[tuple[float, int, Game]] = []
        for i, g in enumerate(pilot_groups):
            if g.cut or not g.trajectories:
                d.deferred.append(g.game)
                continue
            s = sum(g.rewards) / len(g.trajectories)
            if s == 1.0:
                d.evicted.append(g.game)
                self.evicted.add(g.game.game_id)
            if s < self.low:
                d.deferred.append(g.game)
            elif s > self.high:
                d.skipped.append(g.game)
            else:
                qualify.append((abs(s - 0.5), i, g.game))
        keep = {i for _, i, _ in sorted(qualify, key=lambda q: (q[0], q[1]))[: self.B]}
        for _, i, game in qualify:  # pilot order
            (d.commit if i in keep else d.skipped).append(game)
        self._account(pilot_groups, d)
        return d

    def _account(self, pilot_groups: list, d: Decision) -> None:
        committed = {g.game_id for g in d.commit}
        tokens = sum(g.step_tokens for g in pilot_groups)
        n_traj = sum(len(g.trajectories) for g in pilot_groups)
        left_out = len(pilot_groups) - len(d.commit)
        per_traj = tokens / n_traj if n_traj else 0.0
        rest = self.group_size - self.n_p if self.group_size is not None else 0
        self._stats = StageStats(
            decisions={"tasks_piloted": len(pilot_groups), "tasks_committed": len(d.commit),
                       "tasks_deferred": len(d.deferred), "tasks_skipped": len(d.skipped),
                       "tasks_evicted": len(d.evicted)},
            step_tokens_generated=tokens,
            step_tokens_excluded=sum(g.step_tokens for g in pilot_groups if g.game.game_id not in committed),
            step_tokens_avoided=int(round(rest * per_traj * left_out)),
            extra={"evicted_total": len(self.evicted)},
        )

    def observe(self, groups: list) -> None:
        """Nothing to learn from the final outcome: the pilot already decided."""

    def stats(self) -> StageStats:
        return self._stats

    def state_dict(self) -> dict:
        return {"evicted": sorted(self.evicted)}

    def load_state_dict(self, state: dict) -> None:
        self.evicted = set(state["evicted"])
