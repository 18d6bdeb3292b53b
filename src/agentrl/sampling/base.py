"""The Sampler contract: token ids in, exact token ids and their log-probs out.

Exact tokens are the contract (DESIGN.md): the learner trains on the ids the sampler saw
and produced, never on re-rendered text. Log-probs are the raw model's (temperature 1, no
top-p), i.e. what a teacher-forced learner computes, so the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 96

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including the stop token if one was produced
    logprobs: list[float]  # raw-model log p of each generated id
    text: str  # generated text without special tokens
    finish_reason: str  # "stop" (a stop token was produced) | "length" (max_new_tokens)
    adapter_version: int | None = field(default=None)


@runtime_checkable
class Sampler(Protocol):
    tokenizer: object
    max_model_len: int | None  # longest prompt + completion the sampler serves (None: no limit)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, keys: list | None = None
    ) -> list[Completion]:
        """One completion per prompt (token ids), in order. seeds[i] makes row i reproducible;
        keys[i] names the sequence (trajectory) prompt i continues, so a backend may reuse its
        KV cache (a hint: results must not depend on it)."""
        ...

    def load_adapter(self, path: str, version: int | None = None) -> None:
        """Use the PEFT adapter in `path` from now on; the base model stays loaded."""
        ...

    def release(self, keys: list) -> None:
        """The sequences named by `keys` are over (their trajectories ended): a backend that keeps
        per-key state (the hf sampler's KV slots) frees it at once. A no-op where there is none."""
        ...

    def sleep(self) -> None:
        """Give accelerator memory back while a learner on the same device updates; the next
        generate or load_adapter takes it again. A no-op where there is nothing to give."""
        ...
