"""The Sampler contract: token ids in, exact token ids and their log-probs out.

Exact tokens are the contract (DESIGN.md): the learner trains on the ids the sampler saw
and produced, never on re-rendered text. Log-probs are the raw model's (temperature 1, no
top-p), i.e. what a teacher-forced learner computes, so the two can be compared.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentrl.weights import WeightsRef


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 96

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class GenRequest:
    """One row of a generate call.

    - `prompt_ids`: the exact token ids to continue (not empty).
    - `seed`: makes the row reproducible: the same seed, prompt and params give the same tokens
      whatever else is in the call and in whichever order (None: a fresh random seed).
    - `key`: names the sequence (trajectory) this prompt continues, so a backend may reuse its KV
      cache across calls until `release(key)`. A hint: results never depend on it.
    - `constraint`: what the row may generate: a `constraint.CommandSet` (the admissible commands'
      token sequences; the row produces exactly one of them, and its log-probs are the policy's
      renormalised over the tokens that continue one: constraint.py), or None (free text). A backend
      that does not implement constraints refuses a request with one.
    """

    prompt_ids: Sequence[int]
    seed: int | None = None
    key: Hashable | None = None
    constraint: object | None = None


def check_requests(requests: Sequence[GenRequest], constraints: bool = False) -> None:
    """What every backend refuses, with the same errors (`constraints`: the backend implements them)."""
    from agentrl.sampling.constraint import CommandSet

    for r in requests:
        if len(r.prompt_ids) == 0:
            raise ValueError("empty prompt")
        if r.constraint is not None and not constraints:
            raise ValueError("constrained decoding is not implemented by this sampler (GenRequest.constraint must be None)")
        if r.constraint is not None and not isinstance(r.constraint, CommandSet):
            raise ValueError(f"GenRequest.constraint must be a CommandSet, not {type(r.constraint).__name__}")


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including the stop token if one was produced
    logprobs: list[float]  # raw-model log p of each generated id (constrained: renormalised over the allowed ids)
    text: str  # generated text without special tokens
    finish_reason: str  # "stop" (a stop token was produced) | "length" (max_new_tokens)
    adapter_version: int | None = field(default=None)


@runtime_checkable
class Sampler(Protocol):
    """What the rollout, the loop and the selection stages use of a sampler backend (hf, vllm,
    Ray replicas). Every backend implements every method; a no-op where it has nothing to do."""

    tokenizer: object
    max_model_len: int | None  # longest prompt + completion the sampler serves (None: no limit)
    adapter_version: int | None  # the `WeightsRef.version` served now (None: the base model, never loaded)

    @property
    def model(self) -> object | None:
        """The in-process torch model the sampler runs (hidden states for --select arrol); None where
        the weights live elsewhere (a vLLM engine, replica actors)."""
        ...

    def generate(self, requests: Sequence[GenRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order; one `params` for the whole call. Each row's tokens
        depend only on its own prompt, seed and params (and the weights served), never on the
        other rows, the batch order or a cached key."""
        ...

    def load(self, weights: WeightsRef) -> None:
        """Serve `weights` from the next generate on (an in-place swap: the base model stays loaded);
        completions are tagged with `weights.version`. A failed load changes nothing."""
        ...

    def rows_that_fit(self, tokens_per_row: int) -> int | None:
        """How many sequences of `tokens_per_row` tokens the sampler's KV memory holds at once (an eval
        steps that many games together); None where the backend manages its own (vLLM, replicas)."""
        ...

    def reserve(self, rows: int, tokens_per_row: int) -> None:
        """`rows` sequences of up to `tokens_per_row` tokens are about to be stepped together (an
        eval's or a rollout's plan): a backend whose KV memory must hold still under captured
        decode steps (the hf sampler on CUDA) sizes it now, once, instead of growing it turn by
        turn. Never changes a completion. A no-op where the backend manages its own memory."""
        ...

    def kv_memory(self) -> dict | None:
        """What the sampler's KV memory held so far: budget_bytes, peak_bytes, the (slots, capacity)
        at the peak, bytes_per_token, caches dropped under the budget (the hf sampler also: its
        reallocations, decode steps built, prefill forwards and their distinct shapes); None where
        the backend manages its own (vLLM, replicas). An eval's summary.json records it beside its plan."""
        ...

    def release(self, keys: list) -> None:
        """The sequences named by `keys` are over (their trajectories ended): a backend that keeps
        per-key state (the hf sampler's KV slots) frees it at once. A no-op where there is none."""
        ...

    def sleep(self) -> None:
        """Give accelerator memory back while a learner on the same device updates; the next
        generate or load takes it again. A no-op where there is nothing to give."""
        ...

    def close(self) -> None:
        """Free what the sampler holds outside this process (replica actors). A no-op elsewhere."""
        ...
