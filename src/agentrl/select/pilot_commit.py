"""Pilot-Commit: a cheap pilot decides which tasks get the rest of their group.

After Pilot-Commit (seed paper 004), following the authors' code (databricks/pilot-commit at
6def20e: T = recipe/pc/pc_ray_trainer.py, R = recipe/pc/replay_buffer.py, Y =
recipe/pc/config/pc_trainer.yaml, S1/S2 = train_scripts/pc_qwen2.5-1.5b_p32c96.sh and
pc_qwen3-4b_p16c48.sh). Per iteration, with B tasks and G trajectories a task:

1. rounds (at most `max_rounds`, 10: Y 22, S1/S2 l.28) until the batch holds B tasks:
   - commit: take min(B - in batch, buffer size) passed tasks from the replay buffer (R 125-183:
     `max_variance`, highest pilot reward std then newest, S1 l.31; or `random`, Y 25 / S2) and
     roll out their other G - n_pilot trajectories; each joins the batch as one group, pilot
     + commit (T 659-661: GRPO's mean and std run over both);
   - pilot: roll out n_pilot trajectories on pilot_factor x B fresh tasks (gen = 3 x train,
     S1/S2 l.35) and bin each by its pilot success rate s (T 312-319): low <= s <= high passes
     into the buffer (T 632-638), the rest is dropped for now; s >= `evict_at` evicts the task
     for the rest of the run (T 338-350; off by default as in Y 29, the scripts use 1.0 with
     16 to 32 pilots);
2. after the iteration, buffer entries older than 4 iterations are dropped (R 83-85, `>`,
   buffer_max_off_steps 4: Y 24).

Defaults: n_pilot = G / 4 (the scripts' 32/96 and 16/48 pilot/commit split), low 0.125, high
0.75 (S1/S2 l.26-27). Adaptations (README, stage table): the authors generate a round's commits
and next pilots in one call; here they are two lockstep calls of the same round. With G = 8
the pilot has 2 trajectories, so s is 0, 1/2 or 1, and eviction at 1.0 would end a task that
wins half the time after one lucky pair: it stays off unless `evict_at` is set. A batch still
short of B after `max_rounds` trains on what it has (the authors raise, T 669-683). The pilot
runs without step stages (it needs final outcomes); the commit runs with them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from agentrl.env.data import Game
from agentrl.rollout.lockstep import Group
from agentrl.rollout.trajectory import Trajectory
from agentrl.select.base import StageStats, finite_number, settings_check

SAMPLING = ("max_variance", "random")


_check = settings_check("pilot-commit")
_number = finite_number


def success_rate(group) -> float:
    return sum(group.rewards) / len(group.trajectories)


def reward_std(group) -> float:
    r = group.rewards
    m = sum(r) / len(r)
    return math.sqrt(sum((x - m) ** 2 for x in r) / len(r))


@dataclass
class Entry:
    """A task that passed its pilot, waiting for its commit (R 64-68)."""

    game: Game
    pilot: object  # the pilot Group (its n_pilot trajectories)
    iteration: int  # when it was piloted
    std: float


@dataclass
class Decision:
    passed: list[Game] = field(default_factory=list)
    dropped: list[Game] = field(default_factory=list)  # too correct, too incorrect or cut: back to the pool
    evicted: list[Game] = field(default_factory=list)  # newly evicted this round


class PilotCommit:
    """Pilot, buffer, commit; see the module docstring for the rule."""

    name = "pilot-commit"
    point = "before"

    def __init__(self, n_p: int = 2, pilot_factor: float = 3, low: float = 0.125, high: float = 0.75,
                 group_size: int | None = None, evict_at: float | None = None, max_rounds: int = 10,
                 max_age: int = 4, sampling: str = "max_variance", seed: int = 0):
        _check(isinstance(n_p, int) and not isinstance(n_p, bool) and n_p >= 1, f"n_p must be an integer >= 1, got {n_p!r}")
        if group_size is not None:
            _check(n_p < group_size, f"n_p must be < the group size G={group_size}, got {n_p}")
        _check(_number(pilot_factor) and pilot_factor >= 1, f"pilot_factor must be >= 1, got {pilot_factor!r}")
        _check(_number(low) and _number(high) and 0 <= low < high <= 1,
               f"need 0 <= low < high <= 1, got low={low!r} high={high!r}")
        _check(evict_at is None or (_number(evict_at) and 0 < evict_at <= 1), f"evict_at must be in (0, 1] or off, got {evict_at!r}")
        _check(isinstance(max_rounds, int) and max_rounds >= 1, f"max_rounds must be an integer >= 1, got {max_rounds!r}")
        _check(isinstance(max_age, int) and max_age >= 0, f"max_age must be an integer >= 0, got {max_age!r}")
        _check(sampling in SAMPLING, f"sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
        self.n_p, self.pilot_factor, self.low, self.high = n_p, pilot_factor, float(low), float(high)
        self.group_size = group_size  # G; only for the tokens-avoided estimate
        self.evict_at, self.max_rounds, self.max_age, self.sampling = evict_at, max_rounds, max_age, sampling
        self.rng = random.Random(seed)
        self.evicted: set[str] = set()
        self.buffer: dict[str, Entry] = {}  # game_id -> entry (a task piloted again overwrites its entry: R 64)
        self.committed: set[str] = set()  # this iteration's batch: never piloted again in it (T 692: distinct prompts)
        self._warned = False
        self.iteration = 0
        self._stats = StageStats()

    def is_evicted(self, game_id: str) -> bool:
        return game_id in self.evicted

    def begin(self, iteration: int) -> None:
        self.iteration = iteration
        self.committed = set()
        self._stats = StageStats(decisions={k: 0 for k in ("tasks_piloted", "tasks_passed", "tasks_committed",
                                                           "tasks_dropped", "tasks_evicted", "rounds")})

    # ------------------------------------------------------------------ the rounds
    def pilot_tasks(self, candidates: Iterable[Game], B: int) -> list[Game]:
        """The next ceil(pilot_factor x B) distinct candidates neither evicted, in the buffer nor
        committed this iteration. Reads no candidate past the last one it takes (the stream goes
        on into the next round)."""
        n = math.ceil(self.pilot_factor * B)
        out: list[Game] = []
        seen: set[str] = set()
        for game in candidates:
            gid = game.game_id
            if gid in self.evicted or gid in self.buffer or gid in seen or gid in self.committed:
                continue
            out.append(game)
            seen.add(gid)
            if len(out) >= n:
                break
        return out

    def take(self, n: int) -> list[Entry]:
        """Up to n buffered tasks to commit, removed from the buffer (R 125-183)."""
        entries = list(self.buffer.values())
        if len(entries) > n:
            if self.sampling == "max_variance":  # R 256-257: pilot std, then the newest
                entries.sort(key=lambda e: (e.std, e.iteration), reverse=True)
                entries = entries[:n]
            else:
                entries = self.rng.sample(entries, n)
        for e in entries:
            del self.buffer[e.game.game_id]
            self.committed.add(e.game.game_id)
        return entries

    def decide(self, pilot_groups: list) -> Decision:
        """Bin this round's pilots (T 312-319): passed ones enter the buffer; eviction (T 338-350)."""
        d = Decision()
        for g in pilot_groups:
            if g.cut or not g.trajectories:
                d.dropped.append(g.game)
                continue
            s = success_rate(g)
            if self.evict_at is not None and s >= self.evict_at:
                d.evicted.append(g.game)
                self.evicted.add(g.game.game_id)
            if self.low <= s <= self.high:
                d.passed.append(g.game)
                self.buffer[g.game.game_id] = Entry(g.game, g, self.iteration, reward_std(g))
            else:
                d.dropped.append(g.game)
        st = self._stats.decisions
        st["tasks_piloted"] = st.get("tasks_piloted", 0) + len(pilot_groups)
        st["tasks_passed"] = st.get("tasks_passed", 0) + len(d.passed)
        st["tasks_dropped"] = st.get("tasks_dropped", 0) + len(d.dropped)
        st["tasks_evicted"] = st.get("tasks_evicted", 0) + len(d.evicted)
        self._stats.step_tokens_generated += sum(g.step_tokens for g in pilot_groups)
        return d

    def flush(self) -> None:
        """Drop buffered tasks piloted more than max_age iterations ago (R 83-85)."""
        self.buffer = {k: e for k, e in self.buffer.items() if self.iteration - e.iteration <= self.max_age}

    def account(self, committed: int, pilot_tokens_out_of_loss: int, rounds: int, pilot_traj_tokens: float) -> None:
        st = self._stats
        st.decisions["tasks_committed"] = st.decisions.get("tasks_committed", 0) + committed
        st.decisions["rounds"] = rounds
        st.step_tokens_excluded += pilot_tokens_out_of_loss
        dropped = st.decisions.get("tasks_dropped", 0)
        rest = self.group_size - self.n_p if self.group_size is not None else 0
        st.step_tokens_avoided = int(round(rest * pilot_traj_tokens * dropped))  # full groups never rolled out
        st.extra = {"evicted_total": len(self.evicted), "buffer": len(self.buffer)}

    def nothing_committed(self) -> str | None:
        """Once per run: why an iteration trained on nothing (the authors' rule, but a user needs the reason)."""
        st = self._stats.decisions
        if st.get("tasks_committed", 0) or self._warned:
            return None
        self._warned = True
        return (f"pilot-commit: iteration {self.iteration} committed no task: {st.get('tasks_passed', 0)} of "
                f"{st.get('tasks_piloted', 0)} piloted tasks passed (pilot success in [{self.low:g}, {self.high:g}]) "
                f"in {st.get('rounds', 0)} round(s); is the policy warm-started (--init-adapter)? "
                f"A policy that never wins passes no pilot")

    # ------------------------------------------------------------------ the stage protocol
    def observe(self, groups: list) -> None:
        """Nothing to learn from the final outcome: the pilot already decided."""

    def stats(self) -> StageStats:
        return self._stats

    def state_dict(self) -> dict:
        """The evicted set, the sampling RNG and the buffer with its pilot trajectories (JSON)."""
        return {"evicted": sorted(self.evicted), "rng": self.rng.getstate(),
                "buffer": [{"iteration": e.iteration, "std": e.std, "pilot": [t.to_json() for t in e.pilot.trajectories]}
                           for e in self.buffer.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.evicted = set(state["evicted"])
        if "rng" in state:
            rng = state["rng"]
            self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self.buffer = {}
        for e in state.get("buffer", []):
            trajs = [Trajectory.from_json(t) for t in e["pilot"]]
            self.buffer[trajs[0].game.game_id] = Entry(trajs[0].game, Group(trajs[0].game, trajs), e["iteration"], e["std"])
