"""Behaviour cloning beside RL: the masked NLL (`agentrl sft`'s loss, on walkthroughs or on won
rollouts) and the success replay (`learner.replay_coef`).

Success replay keeps the won trajectories of earlier iterations, by their exact token ids, in a
buffer of the newest `learner.replay_buffer`, and each optimizer step of an update adds
replay_coef x (the mean NLL of its share of the buffer's action tokens) to the policy loss: a
separate term, never inside the clipped ratio, so a win keeps pulling after its group's
advantage has gone to 0 (all-success groups) or the policy has drifted from it. The buffer lives
with the learner (wherever it runs) and is part of its state, so a resumed run trains on the same
buffer as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrl.rollout.trajectory import step_sequences
from agentrl.train.packing import Forked, Packed, trained_hidden

REPLAY_STATE = "success_replay.json"  # in a learner state (a checkpoint's)


def masked_nll_sum(model, batch: Packed | Forked, masks: list[list[int]]) -> tuple[torch.Tensor, int]:
    """(sum of -log p over the reply tokens, their number) of one micro-batch, teacher-forced;
    `masks`: the action masks of its sequences, in the micro-batch's order. The vocabulary
    projection runs on the reply positions only (about a tenth of the tokens)."""
    hidden, targets, _, _ = trained_hidden(model, batch, masks)
    logits = model.get_output_embeddings()(hidden).float()
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return nll, int(targets.shape[0])


@dataclass
class Cloned:
    """One sequence behaviour cloning trains on: exact ids, 1 on the tokens it learns."""

    token_ids: list[int]
    action_mask: list[int]


@dataclass
class ReplayPart:
    """A micro-batch of the replay term inside an optimizer step (rows index the step's `Cloned`)."""

    rows: list[list[int]]


class SuccessReplay:
    """The buffer of won trajectories and the BC term it adds to each optimizer step."""

    def __init__(self, coef: float, size: int, history: int = 0):
        self.coef, self.size, self.history = coef, size, history
        self.items: list[Cloned] = []

    def add(self, batch) -> None:
        """Keep the won trajectories of `batch` [(trajectory, advantage)], newest last, at most
        `size` (a trajectory under prompt.history: one sequence per reply, its window then the reply)."""
        for t, _ in batch:
            if getattr(t, "won", False):
                self.items += [Cloned(ids, mask) for ids, mask, _ in step_sequences(t, self.history) if sum(mask)]
        del self.items[: max(0, len(self.items) - self.size)]

    def share(self, step: int, steps_per_epoch: int) -> list[Cloned]:
        """The buffer's part for optimizer step `step` of an update: every epoch passes over it once,
        spread over its minibatches as the batch is."""
        return self.items[step % steps_per_epoch :: steps_per_epoch]

    def parts_and_loss(self, learner, items: list[Cloned]):
        """(micro-batches as ReplayParts, loss_fn(model, rows) -> (coef x NLL sum / tokens, NLL sum, tokens))."""
        if not items or not self.coef:
            return [], None
        sequences = [c.token_ids for c in items]
        n_tokens = max(1, sum(sum(c.action_mask[1:]) for c in items))  # position 0 is never predicted

        def loss_fn(model, rows):
            masks = [items[i].action_mask for row in rows for i in row]
            nll, n = masked_nll_sum(model, learner.inputs(sequences, rows, masks=masks), masks)
            return self.coef * nll / n_tokens, (float(nll.detach()), n)

        return [ReplayPart(rows) for rows in learner.micro_batches([len(s) for s in sequences])], loss_fn

    def save(self, path: Path) -> None:
        (path / REPLAY_STATE).write_text(json.dumps([[c.token_ids, c.action_mask] for c in self.items]))

    def load(self, path: Path) -> None:
        f = path / REPLAY_STATE
        self.items = [Cloned(list(ids), list(mask)) for ids, mask in json.loads(f.read_text())] if f.is_file() else []
