"""GRESO: skip tasks whose recent groups had no reward variance, before rolling them out.

After GRESO (pre-rollout filtering, "Act Only When It Pays", seed paper 002), adapted to
multi-turn agent tasks:

- Per task (game_id) a streak: z = how many of its most recent groups in a row were
  zero-variance of the same kind, "easy" (all won) or "hard" (all lost). A group with variance
  resets z to 0; a zero-variance group of the other kind starts a new streak (z = 1); a group
  cut by the gate has no final label and leaves the streak unchanged.
- Skip probability of a task = 1 - p_kind ** z (z = 0: never skipped), p_easy and p_hard apart.
- `choose` scans a (long, random) candidate stream and keeps each task unless skipped, until
  `want` are chosen: skipped tasks are replaced by further candidates (adaptive rollout batch).
- After each iteration a controller steers each p toward a target zero-variance rate of its
  kind: observed rate above target -> p -= step (skip more), else p += step; p in [p_min, 1].
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.select.base import StageStats

KINDS = ("easy", "hard")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"greso: {message}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


def outcome(group) -> str | None:
    """'easy' (all won), 'hard' (all lost), 'mixed', or None (cut by the gate or empty: no label)."""
    if group.cut or not group.trajectories:
        return None
    if not group.zero_variance:
        return "mixed"
    return "easy" if group.rewards[0] > 0 else "hard"


class Greso:
    """Pre-rollout filter; see the module docstring for the rule."""

    name = "greso"
    point = "before"

    def __init__(self, seed: int = 0, p_start: float = 0.5, target_easy: float = 0.25 / 3,
                 target_hard: float = 0.25 * 2 / 3, step: float = 0.01, p_min: float = 0.05):
        _check(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
               f"seed must be a non-negative integer, got {seed!r}")
        _check(_number(p_min) and 0 < p_min <= 1, f"p_min must be in (0, 1], got {p_min!r}")
        _check(_number(p_start) and p_min <= p_start <= 1, f"p_start must be in [p_min={p_min}, 1], got {p_start!r}")
        _check(_number(step) and 0 <= step <= 1, f"step must be in [0, 1], got {step!r}")
        for kind, t in (("easy", target_easy), ("hard", target_hard)):
            _check(_number(t) and 0 <= t <= 1, f"target_{kind} must be in [0, 1], got {t!r}")
        self.target = {"easy": float(target_easy), "hard": float(target_hard)}
        self.step, self.p_min = float(step), float(p_min)
        self.p = {"easy": float(p_start), "hard": float(p_start)}
        self.streaks: dict[str, tuple[int, str]] = {}  # game_id -> (z, kind); absent = z 0
        self.rng = np.random.default_rng(seed)
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.tasks_skipped = 0
        self.tasks_considered = 0
        self.group_tokens = 0.0  # mean step tokens of a group observed this iteration

    def skip_probability(self, game_id: str) -> float:
        z, kind = self.streaks.get(game_id, (0, "hard"))
        return 1.0 - self.p[kind] ** z if z > 0 else 0.0

    def choose(self, candidates: Iterable[Game], want: int) -> list[Game]:
        """Up to `want` distinct tasks from `candidates` in order, each skipped with its
        probability. Starts a new iteration's accounting. One draw per task considered."""
        self._reset_stats()
        chosen: list[Game] = []
        seen: set[str] = set()
        if want <= 0:
            return chosen
        for game in candidates:
            if game.game_id in seen:
                continue  # a repeat in the stream: not a new decision
            self.tasks_considered += 1
            if self.rng.random() < self.skip_probability(game.game_id):
                self.tasks_skipped += 1
                continue
            chosen.append(game)
            seen.add(game.game_id)
            if len(chosen) >= want:
                break
        return chosen

    def observe(self, groups: list) -> None:
        """Update each task's streak from its group, then step the controller."""
        counts = {"easy": 0, "hard": 0, "mixed": 0}
        for g in groups:
            kind = outcome(g)
            if kind is None:
                continue  # no final label: streak unchanged
            counts[kind] += 1
            gid = g.game.game_id
            if kind == "mixed":
                self.streaks.pop(gid, None)
                continue
            z, last = self.streaks.get(gid, (0, kind))
            self.streaks[gid] = (z + 1 if last == kind else 1, kind)
        labelled = sum(counts.values())
        if labelled:
            for kind in KINDS:
                rate = counts[kind] / labelled
                p = self.p[kind] - self.step if rate > self.target[kind] else self.p[kind] + self.step
                self.p[kind] = min(1.0, max(self.p_min, p))
        self.group_tokens = sum(g.step_tokens for g in groups) / len(groups) if groups else 0.0

    def stats(self) -> StageStats:
        return StageStats(
            decisions={"tasks_skipped": self.tasks_skipped, "tasks_considered": self.tasks_considered},
            step_tokens_avoided=int(round(self.tasks_skipped * self.group_tokens)),
            extra={"p_easy": self.p["easy"], "p_hard": self.p["hard"]},
        )

    def state_dict(self) -> dict:
        return {
            "streaks": {gid: [z, kind] for gid, (z, kind) in self.streaks.items()},
            "p_easy": self.p["easy"],
            "p_hard": self.p["hard"],
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.streaks = {gid: (int(z), str(kind)) for gid, (z, kind) in state["streaks"].items()}
        self.p = {"easy": float(state["p_easy"]), "hard": float(state["p_hard"])}
        self.rng.bit_generator.state = state["rng"]
