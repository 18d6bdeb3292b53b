"""The admissible action space on vLLM (issue 48): a row produces exactly one of its commands' token
sequences, with the policy of constraint.py (the model's softmax renormalised over the tokens
that continue an alive command), on vLLM's own engine.

- Sampling: a V1 logits processor (`AdmissibleCommands`, vLLM's `AdapterLogitsProcessor`, given
  to the engine as `logits_processors`) masks each constrained row's logits to the allowed tokens
  before vLLM samples; a row's commands travel in its `SamplingParams.extra_args`. It walks the
  commands' trie on the host, one step per generated token (a host round trip per token that
  vLLM's own structured decoding also makes); the hf sampler's device tables are not used here.
- Log-probs: vLLM's `raw_logprobs` are taken before logits processors (temperature 1, unmasked),
  and `SamplingParams.logprob_token_ids` returns them for every id any of the row's commands
  holds (at most vLLM's 128), so the sampler renormalises on the host:
  log p(t) - logsumexp(log p(allowed)), exactly what the learner computes from the allowed ids the
  rollout stores (`CommandSet.allowed_along`). A forced token (one allowed) is exactly 0.

Imported only by the vLLM backend (it subclasses vLLM's class); the engine process imports it by
name, so it lives in an installed module, not a closure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

EXTRA_ARG = "agentrl_commands"  # SamplingParams.extra_args key: the row's commands' token ids
try:  # the most ids SamplingParams.logprob_token_ids takes (vLLM's sampler allocates that width)
    from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS
except ImportError:  # pragma: no cover - releases without the constant
    MAX_LOGPROB_TOKEN_IDS = 128


class CommandWalk:
    """One row's position in its commands' trie, advanced by the tokens it has produced."""

    def __init__(self, commands: Sequence[Sequence[int]]):
        self.commands = [tuple(int(i) for i in c) for c in commands]
        self.alive = list(range(len(self.commands)))
        self.seen = 0

    def allowed(self, output_ids: Sequence[int]) -> list[int]:
        if len(output_ids) < self.seen:  # the engine restarted the row (preemption): walk again
            self.alive, self.seen = list(range(len(self.commands))), 0
        while self.seen < len(output_ids):
            t, tok = self.seen, output_ids[self.seen]
            self.alive = [i for i in self.alive if len(self.commands[i]) > t and self.commands[i][t] == tok]
            self.seen += 1
        t = len(output_ids)
        return sorted({self.commands[i][t] for i in self.alive if len(self.commands[i]) > t})

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed(output_ids)
        if not allowed:  # past the command's stop token: nothing left to constrain (constraint.py's rule)
            return logits
        masked = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, device=logits.device)
        masked[index] = logits[index]
        return masked


class AdmissibleCommands(AdapterLogitsProcessor):
    """vLLM's per-request hook: rows whose extra_args carry commands are walked and masked."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides which token greedy takes

    def new_req_logits_processor(self, params):
        commands = (params.extra_args or {}).get(EXTRA_ARG)
        return CommandWalk(commands) if commands else None


def command_token_ids(commands: Sequence[Sequence[int]]) -> list[int]:
    """Every id the commands hold: the ids whose raw log-probs a constrained row asks vLLM for."""
    return sorted({int(i) for c in commands for i in c})


def renormalised(token_ids: Sequence[int], raw: Sequence[dict[int, float]], allowed: Sequence[Sequence[int]]) -> list[float]:
    """Each generated token's log-prob renormalised over the ids allowed where it was produced:
    log p(t) - logsumexp(log p(a) for a allowed); exactly 0 where one was allowed."""
    out = []
    for tok, logprobs, ids in zip(token_ids, raw, allowed, strict=True):
        if not ids:  # no command alive there (constraint.py: unconstrained)
            out.append(logprobs[tok])
            continue
        if len(ids) == 1:
            out.append(0.0)
            continue
        values = [logprobs[a] for a in ids]
        top = max(values)
        out.append(logprobs[tok] - (top + math.log(sum(math.exp(v - top) for v in values))))
    return out
