"""The trainer's seam: the `Learner` protocol the training loop drives, and what crosses from the
loop to a learner (in this process, its own process or a Ray actor): the trajectories as plain
data, the update's `UpdateStats`, the `WeightsRef` a save hands out, and the error a dead learner
raises. Every layout imports it from here, so none imports another."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from agentrl.errors import RunError
from agentrl.io import atomic_path, read_tree, write_tree
from agentrl.weights import WeightsRef

STATE_WEIGHTS = "adapter"  # the weights' directory inside a learner state (a checkpoint's)


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
    won: bool = False  # the episode was won (the success replay keeps it)
    allowed: list[list[int]] = field(default_factory=list)  # admissible actions: per action token, the ids it was drawn among ([]: free text)


@dataclass
class UpdateStats:
    loss: float  # the first optimizer step's (one step: the update's); the steps' mean is loss_mean
    grad_l2_norm: float  # before clipping, the first step's
    trajectories: int  # in the batch (A = 0 ones included)
    step_tokens_trained: int  # action tokens with A != 0 (a trajectory with none skips forward/backward)
    logprob_gap: float | None  # mean |sampler logp - learner logp| on trained action tokens, before the update
    skipped: bool = False  # a non-finite loss or gradient: no optimizer step
    stepped: bool = True  # the optimizer moved (False: skipped, or no trajectory with A != 0)
    optimizer_steps: int = 1  # learner.epochs x learner.minibatches, less skipped ones
    clip_fraction: float = 0.0  # share of action tokens whose ratio was clipped (0 on the first minibatch)
    kl: float | None = None  # mean KL(policy || warm start) per action token (with learner.kl_coef > 0)
    kl_coef_field: float | None = None  # learner.kl_coef in the field's unit (per action token, as the policy term weighs it)
    replay_nll: float | None = None  # success replay: mean NLL per replayed action token (learner.replay_coef > 0)
    replay_buffer: int | None = None  # success replay: sequences in the buffer after this update's wins joined it
    # over the optimizer steps taken (learner.epochs x minibatches, less skipped ones; None: none taken):
    # with one step these equal loss and grad_l2_norm; with raft's 16 the first step is one sixteenth.
    # loss_mean averages each step's loss in the first step's form (-A logp, + KL and replay terms, at
    # the step's policy), not the clipped surrogate a later step optimises (-r A: another number)
    loss_mean: float | None = None
    grad_l2_norm_mean: float | None = None
    grad_l2_norm_max: float | None = None


@runtime_checkable
class Learner(Protocol):
    """What the training loop asks of a learner, wherever it runs (`remote.make_learner` picks:
    `learner.LocalLearner` in this process, `remote.RemoteLearner` in its own, `ray_learner.RayLearner`
    as a Ray actor). The loop never tells them apart.

    Contract:
    - `version`: the version of the weights it holds: 0 at the start (the warm start, or the base
      model's fresh LoRA), n after its n-th `save`, the checkpoint's after `load_state`.
    - `update(batch)`: [(trajectory or TrainItem, advantage: a number, or one per reply)] -> one
      update (learner.epochs x learner.minibatches optimizer steps, or none when every advantage
      is 0 or the loss is not finite), described by one `UpdateStats`.
    - `save(root)`: version += 1, then the weights written atomically to `root/v{version}` (on
      the caller's machine), complete and never changed afterwards; returns their `WeightsRef`,
      which the caller hands to the sampler.
    - `save_state(path)` writes into `path` (a directory the caller makes atomic) what continues
      the run exactly: the weights in `path/adapter` (STATE_WEIGHTS), the optimizer, the RNG; `load_state(path,
      version)` restores it and returns the `WeightsRef` of the weights it now holds.
    - `close()` frees what it holds (a process, an actor, a GPU); safe to call once at the end.
    - A learner elsewhere that died raises `LearnerDied` at the next call instead of hanging.
    """

    version: int

    def update(self, batch: list) -> UpdateStats: ...

    def save(self, root: Path) -> WeightsRef: ...

    def save_state(self, path: Path) -> None: ...

    def load_state(self, path: Path, version: int) -> WeightsRef: ...

    def close(self) -> None: ...


def train_items(batch) -> list:
    """A batch as plain data for a learner elsewhere: ((token ids, action mask, sampler log-probs,
    step tokens, reply starts, won, allowed ids), advantage: a number or one per step); the learner rebuilds `TrainItem`s."""
    return [((list(t.token_ids), list(t.action_mask), list(t.logprobs), list(t.step_tokens), list(t.reply_starts),
              bool(getattr(t, "won", False)), [list(a) for a in getattr(t, "allowed", ())]),
             [float(x) for x in a] if isinstance(a, (list, tuple)) else float(a)) for t, a in batch]


def from_train_items(items) -> list[tuple[TrainItem, object]]:
    return [(TrainItem(*item), adv) for item, adv in items]


@dataclass
class PackedWeights:
    """A `WeightsRef`'s directory as bytes, to cross machines (Ray's object store): packed where
    the learner wrote it, unpacked by the driver into its own run directory."""

    files: dict[str, bytes]
    version: int
    kind: str = "lora"

    @classmethod
    def pack(cls, ref: WeightsRef) -> PackedWeights:
        return cls(read_tree(ref.path), ref.version, ref.kind)

    def unpack(self, root: Path) -> WeightsRef:
        """Write them as `root/v{version}`, atomically."""
        with atomic_path(Path(root) / f"v{self.version}") as tmp:
            write_tree(self.files, tmp)
        return WeightsRef(Path(root) / f"v{self.version}", self.version, self.kind)
