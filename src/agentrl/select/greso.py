"""GRESO: skip tasks whose recent groups had no reward variance, before rolling them out.

After GRESO (pre-rollout filtering, "Act Only When It Pays", seed paper 002), following the
authors' code (Infini-AI-Lab/GRESO at b277843: PS = verl/trainer/ttis/presampling_selector.py,
RT = verl/trainer/ppo/ray_trainer.py, strategy `all_probabilistic`):

- Per task (game_id) a streak: z = how many of its most recent groups in a row were
  zero-variance of the same kind, "easy" (all won) or "hard" (all lost) (PS 111-114, 131-139:
  counted back over the task's rollouts). A group with variance resets z to 0; a zero-variance
  group of the other kind starts a new streak (z = 1). A task skipped gets no entry: its
  streak is frozen (PS: no trace appended).
- Skip probability of a task = 1 - max(p_kind ** z, 0.01) (PS 117, 142): at most 0.99, so no
  task is skipped for good; z = 0: never skipped. p_easy and p_hard apart.
- `choose` scans a (long, random) candidate stream and keeps each task unless skipped, until
  `want` are chosen: skipped tasks are replaced by further candidates (adaptive rollout batch).
  Refill rounds of the DAPO filter draw through `choose` too (RT 988-1016: every dataloader
  batch, refills included, passes the filter).
- After each iteration a controller steers each p toward a target zero-variance rate of its
  kind (target 0.25 split easy:hard = 1:2, RT 298-299): rate >= target -> p -= 0.01 (skip
  more), else p += 0.01; p in [0.05, 0.95] (RT 1199-1219). p does not move during the first
  epoch (RT 1207, `if epoch > 0`); an epoch here is a full pass over the training pool, counted
  in tasks considered.

Adaptations for agentrl (README, stage table): a group cut by the gate has no final label and
leaves its task's streak and the controller's rates unchanged; Pilot-Commit's pilot groups
(n_pilot trajectories, not a full group) do not update streaks or rates unless
`count_pilots` (the authors never pilot).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from agentrl.env.data import Game
from agentrl.select.base import StageStats, finite_number, settings_check

KINDS = ("easy", "hard")


_check = settings_check("greso")
_number = finite_number


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
                 target_hard: float = 0.25 * 2 / 3, step: float = 0.01, p_min: float = 0.05, p_max: float = 0.95,
                 keep_floor: float = 0.01, pool_size: int | None = None, count_pilots: bool = False):
        _check(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
               f"seed must be a non-negative integer, got {seed!r}")
        _check(_number(p_min) and 0 < p_min <= 1, f"p_min must be in (0, 1], got {p_min!r}")
        _check(_number(p_max) and p_min <= p_max <= 1, f"p_max must be in [p_min={p_min}, 1], got {p_max!r}")
        _check(_number(p_start) and p_min <= p_start <= p_max, f"p_start must be in [p_min={p_min}, p_max={p_max}], got {p_start!r}")
        _check(_number(keep_floor) and 0 <= keep_floor <= 1, f"keep_floor must be in [0, 1], got {keep_floor!r}")
        _check(_number(step) and 0 <= step <= 1, f"step must be in [0, 1], got {step!r}")
        for kind, t in (("easy", target_easy), ("hard", target_hard)):
            _check(_number(t) and 0 <= t <= 1, f"target_{kind} must be in [0, 1], got {t!r}")
        self.target = {"easy": float(target_easy), "hard": float(target_hard)}
        self.step, self.p_min, self.p_max, self.keep_floor = float(step), float(p_min), float(p_max), float(keep_floor)
        self.pool_size, self.count_pilots = pool_size, count_pilots
        self.considered_total = 0  # tasks considered over the run: the epoch count (p is frozen in epoch 0)
        self.p = {"easy": float(p_start), "hard": float(p_start)}
        self.streaks: dict[str, tuple[int, str]] = {}  # game_id -> (z, kind); absent = z 0
        self.rng = np.random.default_rng(seed)
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.tasks_skipped = 0
        self.tasks_considered = 0
        self.group_tokens = 0.0  # mean step tokens of a group observed this iteration

    def begin(self, iteration: int) -> None:
        """A new iteration's accounting (every round of it, refills included, adds to it)."""
        self._reset_stats()

    def skip_probability(self, game_id: str) -> float:
        z, kind = self.streaks.get(game_id, (0, "hard"))
        return 1.0 - max(self.p[kind] ** z, self.keep_floor) if z > 0 else 0.0  # PS 117, 142

    @property
    def epoch(self) -> int:
        """Full passes over the training pool so far (0 until the pool size is known)."""
        return self.considered_total // self.pool_size if self.pool_size else 0

    def choose(self, candidates: Iterable[Game], want: int, refill: bool = False) -> list[Game]:
        """Up to `want` distinct tasks from `candidates` in order, each skipped with its
        probability. One draw per task considered. A new iteration's accounting starts unless
        `refill` (a DAPO refill round of the same iteration)."""
        if not refill:
            self._reset_stats()
        chosen: list[Game] = []
        if want <= 0:
            return chosen
        for game in self.passing(candidates):
            chosen.append(game)
            if len(chosen) >= want:
                break
        return chosen

    def passing(self, candidates: Iterable[Game]):
        """The distinct candidates, in order, that the skip coin lets through (lazily: a caller
        that stops early has drawn no coin for the rest)."""
        seen: set[str] = set()
        for game in candidates:
            if game.game_id in seen:
                continue  # a repeat in the stream: not a new decision
            seen.add(game.game_id)
            self.tasks_considered += 1
            self.considered_total += 1
            if self.rng.random() < self.skip_probability(game.game_id):
                self.tasks_skipped += 1
                continue
            yield game

    def observe(self, groups: list) -> None:
        """Update each task's streak from its group, then step the controller (after epoch 0)."""
        counts = {"easy": 0, "hard": 0, "mixed": 0}
        epoch = (self.considered_total - 1) // self.pool_size if self.pool_size and self.considered_total else 0
        for g in groups:
            if getattr(g, "excluded_by", None) == "pilot-commit" and not self.count_pilots:
                continue  # a pilot of n_pilot trajectories, not a group GRESO would have seen
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
        if labelled and epoch > 0:  # RT 1207: p stays put during the first epoch
            for kind in KINDS:
                rate = counts[kind] / labelled
                p = self.p[kind] - self.step if rate >= self.target[kind] else self.p[kind] + self.step  # RT 1208-1215
                self.p[kind] = min(self.p_max, max(self.p_min, p))
        self.group_tokens = sum(g.step_tokens for g in groups) / len(groups) if groups else 0.0

    def stats(self) -> StageStats:
        return StageStats(
            decisions={"tasks_skipped": self.tasks_skipped, "tasks_considered": self.tasks_considered},
            step_tokens_avoided=int(round(self.tasks_skipped * self.group_tokens)),
            extra={"p_easy": self.p["easy"], "p_hard": self.p["hard"], "epoch": self.epoch},
        )

    def state_dict(self) -> dict:
        return {
            "streaks": {gid: [z, kind] for gid, (z, kind) in self.streaks.items()},
            "p_easy": self.p["easy"],
            "p_hard": self.p["hard"],
            "rng": self.rng.bit_generator.state,
            "considered_total": self.considered_total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.streaks = {gid: (int(z), str(kind)) for gid, (z, kind) in state["streaks"].items()}
        self.p = {"easy": float(state["p_easy"]), "hard": float(state["p_hard"])}
        self.rng.bit_generator.state = state["rng"]
        self.considered_total = int(state.get("considered_total", 0))
