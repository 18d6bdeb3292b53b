"""Trajectory records. Exact tokens: `token_ids` is the full sequence the sampler saw and
produced, [prompt, a_1, o_2, a_2, ...]; `action_mask` is 1 on generated tokens only and
`logprobs` holds the sampler's log-prob there (0.0 elsewhere)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from agentrl.env.data import Game, task_object
from agentrl.errors import RunError


class GroupOutcome:
    """What a group's G outcomes say (a rollout's Group, Tier 2's BufferGroup): its `trajectories`
    each carry a `reward`."""

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def zero_variance(self) -> bool:
        """All G rewards equal: the group teaches GRPO nothing."""
        return len(set(self.rewards)) <= 1


@dataclass
class Step:
    response: str  # the model's text (or the walkthrough command)
    action: str | None  # parsed from the response; None if unparsable
    command: str | None  # the admissible command it mapped to; None = invalid (a no-op)
    observation: str
    won: bool
    done: bool
    match_score: float = 100.0

    @property
    def valid(self) -> bool:
        return self.command is not None


@dataclass
class Trajectory:
    game: Game
    index: int = 0  # trajectory index within its group
    initial_observation: str = ""
    admissible: list[str] = field(default_factory=list)  # current admissible commands
    steps: list[Step] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # generated tokens per step
    reply_starts: list[int] = field(default_factory=list)  # offset in token_ids where each reply begins
    adapter_versions: list[int | None] = field(default_factory=list)  # the sampler's adapter version per step
    cut_steps: list[int] = field(default_factory=list)  # replies cut at max_new_tokens (no end-of-turn), by step index
    # admissible actions (sampling.action_space): per action token, the ids it was drawn among (its constraint
    # at that position; the learner renormalises over them); empty for free text
    allowed: list[list[int]] = field(default_factory=list)
    # sampling.loop_guard: the steps (indices) whose choice the guard narrowed (commands that would go
    # round a cycle again were taken out of the constraint)
    guarded_steps: list[int] = field(default_factory=list)
    # won | lost | max_steps | context_full (the sampler's max_model_len) | gate_cut | pruned | env_error
    stop_reason: str | None = None  # None while running
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def to_json(self) -> dict:
        """Everything, JSON-safe (a checkpoint keeps Pilot-Commit's buffered pilots this way)."""
        d = asdict(self)
        d["game"] = {**d["game"], "path": str(self.game.path), "walkthrough": list(self.game.walkthrough)}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        from pathlib import Path

        g = d["game"]
        d = {k: v for k, v in d.items() if k != "replies_cut"}  # a count in records written before cut_steps
        game = Game(**{**g, "path": Path(g["path"]), "walkthrough": tuple(g.get("walkthrough", ())),
                       "untaught": tuple(g.get("untaught", ()))})
        return cls(**{**d, "game": game, "steps": [Step(**s) for s in d["steps"]]})

    @property
    def won(self) -> bool:
        return self.stop_reason == "won"

    @property
    def reward(self) -> float:
        return 1.0 if self.won else 0.0

    @property
    def replies_cut(self) -> int:
        """Replies cut at max_new_tokens: a policy drifting into junk shows here first."""
        return len(self.cut_steps)

    @property
    def invalid_actions(self) -> int:
        return sum(not s.valid for s in self.steps)

    def append(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        if generated:
            self.reply_starts.append(len(self.token_ids))
        self.token_ids.extend(ids)
        self.action_mask.extend([1 if generated else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def summary(self) -> dict:
        """The per-episode record written by `agentrl eval` (no tokens)."""
        return {
            "task_id": self.game.game_id,
            "split": self.game.split,
            "task_type": self.game.task_type,
            "trajectory": self.index,
            "won": self.won,
            "reward": self.reward,
            "steps": len(self.steps),
            "stop_reason": self.stop_reason,
            "invalid_actions": self.invalid_actions,
            "actions": [s.command if s.valid else s.action for s in self.steps],
            "error": self.error,
        }

    def record(self) -> dict:
        """Everything, tokens included (for trajectories.jsonl)."""
        out = self.summary()
        out["initial_observation"] = self.initial_observation
        out["step_records"] = [asdict(s) | {"valid": s.valid} for s in self.steps]
        out["token_ids"] = self.token_ids
        out["action_mask"] = self.action_mask
        out["logprobs"] = self.logprobs
        out["step_tokens"] = self.step_tokens
        out["reply_starts"] = self.reply_starts
        out["adapter_versions"] = self.adapter_versions
        if self.allowed:
            out["allowed"] = self.allowed
        if self.guarded_steps:
            out["guarded_steps"] = self.guarded_steps
        return out


def played(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The trajectories the env let run. One whose env failed (a game that would not load, a worker
    that died: `env_error`) is no outcome of the policy: success rates, their intervals and the
    advantages leave it out, and say how many they left out."""
    return [t for t in trajectories if t.stop_reason != "env_error"]


def played_or_stop(trajectories: list[Trajectory], what: str) -> list[Trajectory]:
    """`played`, refusing in one line when the env ran none of them: a 0% would be the env's
    failure, not the policy's (`what` names them, e.g. "iteration 3: ... trajectories")."""
    ran = played(trajectories)
    if trajectories and not ran:
        raise RunError(f"the env failed on all {len(trajectories)} {what} (first: {trajectories[0].error})")
    return ran


LOOP_WINDOW, LOOP_PERIOD = 12, 6  # the last 12 steps repeat a cycle of at most 6 commands


def looped(t: Trajectory) -> bool:
    """The episode ran out of steps going round a cycle: its last LOOP_WINDOW commands repeat with a
    period of at most LOOP_PERIOD (an invalid reply counts as its text: it changes nothing either).
    A greedy policy that returns to a state it saw repeats itself; this names that failure."""
    if t.stop_reason != "max_steps" or len(t.steps) < LOOP_WINDOW:
        return False
    tail = step_commands(t)[-LOOP_WINDOW:]
    return any(all(tail[i] == tail[i - p] for i in range(p, LOOP_WINDOW)) for p in range(1, LOOP_PERIOD + 1))


def took_another_object(t: Trajectory) -> bool | None:
    """The episode's first `take` picked up something other than the task's object (None: it took
    nothing, or the game names no object). A policy cloned on walkthroughs takes whatever is where
    it went first; this names that failure (docs/measurements/decoys.md)."""
    obj = task_object(t.game)
    first = next((c for c in step_commands(t) if c.startswith("take ")), None)
    if obj is None or first is None:
        return None
    return first.split(" ")[1] != obj


def step_commands(t: Trajectory) -> list[str]:
    """What each step did: the admissible command, or an invalid reply's text (it changes nothing either)."""
    return [s.command if s.command is not None else s.response.strip() for s in t.steps]


def repeats_a_cycle(history: list[str], command: str, max_period: int) -> bool:
    """`command` would go round a cycle of at most `max_period` commands a second time in a row:
    with it, the last p commands equal the p before them (p = 1: the previous command again). In a
    deterministic world a cycle gone round again ends where it began, so it changes nothing."""
    seq = history + [command]
    return any(len(seq) >= 2 * p and seq[-p:] == seq[-2 * p:-p] for p in range(1, max_period + 1))


def behaviour_metrics(trajectories: list[Trajectory]) -> dict:
    """What the policy did, per iteration and per eval: the share of steps whose reply mapped to an
    admissible command, mean generated tokens per reply, mean episode length (steps) and success
    by task type, the share of replies cut at max_new_tokens, the share of episodes that ran out
    of steps going round a cycle (`looped`), and of those that took something, the share whose first
    take was another object than the task's (`took_another_object`). Cut or pruned trajectories
    count for the steps they took."""
    steps = [s for t in trajectories for s in t.steps]
    replies = [n for t in trajectories for n in t.step_tokens]
    by_type: dict[str, list[bool]] = {}
    for t in trajectories:
        by_type.setdefault(t.game.task_type, []).append(t.won)
    return {
        "valid_action_rate": round(sum(s.valid for s in steps) / len(steps), 4) if steps else None,
        "mean_reply_tokens": round(sum(replies) / len(replies), 2) if replies else None,
        "replies_cut_rate": round(sum(t.replies_cut for t in trajectories) / len(replies), 4) if replies else None,
        "looped_rate": round(sum(map(looped, trajectories)) / len(trajectories), 4) if trajectories else None,
        # of the episodes that took something, those whose first take was not the task's object
        "other_object_rate": round(sum(took) / len(took), 4) if (took := [x for x in map(took_another_object, trajectories)
                                                                            if x is not None]) else None,
        # sampling.loop_guard: the share of steps whose choice it narrowed
        "guarded_rate": round(sum(len(t.guarded_steps) for t in trajectories) / len(steps), 4) if steps else None,
        "mean_episode_steps": round(sum(len(t.steps) for t in trajectories) / len(trajectories), 2) if trajectories else None,
        "success_by_task_type": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_type.items())},
    }


# ---------------------------------------------------------------- prompt.history: the windowed view
# A trajectory's token_ids are the whole episode, [opening] + a_1 + o_2 + a_2 + ... (o_i: the closing
# of the reply's turn, the observation, the next assistant header). Under prompt.history N the policy
# sees, before reply i, the opening (system, example, first observation: the task) and the last N
# replies with what followed them: the same ids, the turns in between left out. So the window is
# token-exact (nothing re-tokenised) and the SFT data, the sampler and the learner all cut it alike.
def window(traj, history: int, reply: int | None = None) -> list[int]:
    """The ids the policy conditions on before reply number `reply` (0-based; None: the next one).
    `traj`: anything with token_ids and reply_starts (a Trajectory, a TrainItem)."""
    starts = traj.reply_starts
    i = len(starts) if reply is None else reply
    end = starts[i] if i < len(starts) else len(traj.token_ids)
    if not history or i <= history:
        return list(traj.token_ids[:end])
    return list(traj.token_ids[: starts[0]]) + list(traj.token_ids[starts[i - history] : end])


def step_sequences(traj, history: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Under prompt.history N: one (ids, action mask, sampler log-probs) per reply, its window then
    the reply itself (what the sampler saw and produced at that step); the learner and the SFT
    data train on these. With N = 0 this is the whole trajectory, once."""
    if not history:
        return [(list(traj.token_ids), list(traj.action_mask), list(traj.logprobs))]
    out = []
    for i, (start, n) in enumerate(zip(traj.reply_starts, traj.step_tokens)):
        context = window(traj, history, i)
        out.append((context + list(traj.token_ids[start : start + n]), [0] * len(context) + [1] * n,
                    [0.0] * len(context) + list(traj.logprobs[start : start + n])))
    return out


def step_allowed(traj, history: int) -> list[list[list[int]]]:
    """The allowed ids (admissible actions) of each of `step_sequences`' sequences, in the same order:
    per reply its own action tokens' (the whole list once with N = 0); [] for free text."""
    allowed = list(getattr(traj, "allowed", ()) or ())
    if not history or not allowed:
        return [allowed] * (1 if not history else len(traj.reply_starts))
    out, at = [], 0
    for n in traj.step_tokens:
        out.append(allowed[at : at + n])
        at += n
    return out


# An advantage is a number per trajectory (GRPO) or a list with one per reply (GiGPO).
def is_zero(a) -> bool:
    """No signal: a trajectory's advantage (a number, or one per step) is zero everywhere."""
    return all(x == 0.0 for x in a) if isinstance(a, (list, tuple)) else a == 0.0


def token_advantages(traj, a) -> list[float]:
    """One advantage per token of `traj.token_ids`: 0 off the action mask; a per-step advantage
    lands on exactly that step's reply tokens (the step_tokens[t] generated ids of step t)."""
    if not isinstance(a, (list, tuple)):
        return [float(a) if m else 0.0 for m in traj.action_mask]
    if len(a) != len(traj.step_tokens) or sum(traj.step_tokens) != sum(traj.action_mask):
        raise ValueError(f"{len(a)} step advantages for {len(traj.step_tokens)} replies "
                         f"({sum(traj.step_tokens)} step tokens, {sum(traj.action_mask)} action tokens)")
    per_token = iter(x for x, n in zip(a, traj.step_tokens) for _ in range(n))
    return [next(per_token) if m else 0.0 for m in traj.action_mask]


def trained_tokens(traj, a) -> int:
    """Action tokens that carry a non-zero advantage (what the update spends its signal on)."""
    if not isinstance(a, (list, tuple)):
        return 0 if a == 0.0 else sum(traj.action_mask)
    return sum(n for x, n in zip(a, traj.step_tokens) if x != 0.0)


def zero_advantage_tokens(traj, a) -> int:
    """Generated tokens (step_tokens) whose advantage is zero: generated, not trained."""
    if not isinstance(a, (list, tuple)):
        return sum(traj.step_tokens) if a == 0.0 else 0
    return sum(n for x, n in zip(a, traj.step_tokens) if x == 0.0)
