"""ARRoL inside a rollout: the `step` stage that prunes trajectories of a group at env step K.

`Arrol` (arrol.py) holds the quality head, its calibration and the keep rule; this adapter feeds
it: right after env step K (`run_lockstep` calls `at_step` for every group the gate left alone)
it reads the policy's last-layer hidden state at the last token of each running trajectory (the
end of its step-K turn: the reply and the observation that answered it), and, once the cold
start is over, stops the trajectories the keep rule drops. They leave `group.trajectories` for
`group.pruned` (generated, paid for, kept out of the loss) with stop_reason "pruned". At the end
of the iteration (`observe`) the step-K features of the trajectories that ran to a real outcome
are paired with their final rewards and train the head.
"""

from __future__ import annotations

import torch

from agentrl.select.arrol import Arrol
from agentrl.select.base import StageStats

# outcomes that are the trajectory's own (a gate cut, a prune or an env failure is not)
_REAL_OUTCOMES = ("won", "lost", "max_steps", "context_full")


def _hidden_size(model) -> int:
    config = model.config  # a PeftModel forwards .config to its base model
    if not hasattr(config, "hidden_size") and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.hidden_size)


class ArrolStage:
    """`model`: the policy's causal LM, the one the sampler generates with (a PeftModel works),
    or the sampler itself (anything with a `.model` that is not a torch module): then the model
    is looked up at each call, so an adapter the sampler loads later (`load` may wrap
    the model in a PeftModel) is the one whose hidden states are read.

    `begin(iteration)` takes the training loop's iteration number (counted from 1): the cold
    start covers iterations 1..cold_start, pruning starts at cold_start + 1. Without `begin`, the
    head's own count of observed iterations decides (the same thing on a fresh run)."""

    name = "arrol"
    point = "step"

    def __init__(self, model, K: int = 10, kappa: float = 0.5, cold_start: int = 20, seed: int = 0,
                 max_steps: int = 30, batch_size: int = 8, **arrol_kwargs):
        self._source = model
        self.arrol = Arrol(_hidden_size(self.model), K=K, kappa=kappa, cold_start=cold_start, seed=seed,
                           **arrol_kwargs)
        self.K, self.max_steps, self.batch_size = K, max_steps, max(1, int(batch_size))
        self.iteration: int | None = None
        self._recorded: dict[int, tuple] = {}  # id(trajectory) -> (trajectory, its step-K features [hidden])

    @property
    def model(self):
        src = self._source
        return src if isinstance(src, torch.nn.Module) else src.model

    def begin(self, iteration: int) -> None:
        self.iteration, self._recorded = iteration, {}

    # ------------------------------------------------------------------ features
    @torch.no_grad()
    def features(self, trajectories: list) -> torch.Tensor:
        """[n, hidden] float32 on CPU: the last layer's hidden state at each trajectory's last
        token. Left-padded batches of `batch_size` rows with an attention mask and explicit
        position ids (a row's result does not depend on its batch)."""
        model = self.model
        hidden = _hidden_size(model)
        if not trajectories:
            return torch.zeros(0, hidden)
        device = next(model.parameters()).device
        out = []
        for start in range(0, len(trajectories), self.batch_size):
            rows = [list(t.token_ids) for t in trajectories[start:start + self.batch_size]]
            if any(not r for r in rows):
                raise ValueError("arrol: a trajectory without tokens has no features")
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, width - len(r):] = torch.tensor(r)
                mask[i, width - len(r):] = 1
            positions = (mask.cumsum(1) - 1).clamp_min(0)
            result = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                           position_ids=positions.to(device), output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)  # no [n, L, vocab] logits
            out.append(result.hidden_states[-1][:, -1].detach().to("cpu", torch.float32))
        return torch.cat(out)

    # ------------------------------------------------------------------ the step
    def at_step(self, step: int, group) -> None:
        """Right after env step K: record the running trajectories' features; past the cold
        start, prune those the keep rule drops."""
        if step != self.K or getattr(group, "cut", False):
            return
        running = [t for t in group.trajectories if not t.done]
        finished = [t.reward for t in group.trajectories if t.done]  # counted in the balance, never pruned
        if len(running) < 3:  # 2 running are never pruned (the group keeps an advantage)
            return
        feats = self.features(running)
        for t, f in zip(running, feats):
            self._recorded[id(t)] = (t, f)
        cold = None if self.iteration is None else max(0, self.iteration - 1)  # iterations before this one
        if not self.arrol.should_prune(cold):
            return
        kept = self.arrol.keep(self.arrol.predict(feats), fixed=finished)
        pruned = [t for t, k in zip(running, kept) if not k]
        if not pruned:
            return
        steps = sum(len(t.step_tokens) for t in running)
        per_step = sum(sum(t.step_tokens) for t in running) / steps if steps else 0.0
        gone = {id(t) for t in pruned}
        for t in pruned:
            t.stop_reason = "pruned"
        group.trajectories[:] = [t for t in group.trajectories if id(t) not in gone]  # by identity, not ==
        group.pruned.extend(pruned)
        generated = sum(sum(t.step_tokens) for t in pruned)
        avoided = round(len(pruned) * per_step * max(0, self.max_steps - self.K))
        self.arrol.record_prune(len(pruned), generated, avoided)

    # ------------------------------------------------------------------ learning
    def observe(self, groups: list) -> None:
        """Train the head on (step-K features, final reward) of the trajectories that were
        running at K, stayed in their group and ended with an outcome of their own; close the
        iteration."""
        rows, rewards = [], []
        for g in groups:
            if getattr(g, "cut", False):
                continue
            for t in g.trajectories:
                entry = self._recorded.get(id(t))
                if entry is not None and entry[0] is t and t.stop_reason in _REAL_OUTCOMES:
                    rows.append(entry[1])
                    rewards.append(t.reward)
        if rows:
            self.arrol.observe_features(torch.stack(rows), rewards)
        self.arrol.observe(groups)
        self._recorded = {}

    # ------------------------------------------------------------------ accounting, checkpoints
    def stats(self) -> StageStats:
        return self.arrol.stats()

    def state_dict(self) -> dict:
        return self.arrol.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.arrol.load_state_dict(state)
