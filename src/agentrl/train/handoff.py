"""What crosses from the training loop to a learner elsewhere (its own process or a Ray actor):
the trajectories as plain data, and the error a dead learner raises. Both layouts import it
from here, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.errors import RunError


class LearnerDied(RunError):
    """The learner process exited; the run stops (exit code 1) and can be resumed."""


@dataclass
class TrainItem:
    """What the learner needs of a trajectory (it never sees games or text)."""

    token_ids: list[int]
    action_mask: list[int]
    logprobs: list[float]
    step_tokens: list[int] = field(default_factory=list)  # generated tokens per reply (where a per-step advantage lands)
    reply_starts: list[int] = field(default_factory=list)  # where each reply begins (prompt.history's windows)


def train_items(batch) -> list:
    """A batch as plain data for a learner elsewhere: ((token ids, action mask, sampler log-probs,
    step tokens, reply starts), advantage: a number or one per step); the learner rebuilds `TrainItem`s."""
    return [((list(t.token_ids), list(t.action_mask), list(t.logprobs), list(t.step_tokens), list(t.reply_starts)),
             [float(x) for x in a] if isinstance(a, (list, tuple)) else float(a)) for t, a in batch]
