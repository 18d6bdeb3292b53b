"""`WeightsRef`: the one plain record of which weights a sampler should serve.

The learner hands it out after an update (`save`), the loop hands it to the generator
(`load`), checkpoints and the learner processes pass it across their boundaries. Today it
names a PEFT LoRA adapter directory and its version; issue 48's full fine-tuning adds
`kind="full"` (a model directory) without changing who passes what to whom.

Contract: the directory a ref names is complete when the ref exists (written atomically) and
is never changed afterwards; a sampler that loads a ref serves exactly those weights from its
next generate on (an in-place swap: the base model stays resident), and tags its completions
with `version`.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("lora",)  # issue 48: "full"


@dataclass(frozen=True)
class WeightsRef:
    path: str  # the adapter directory (PEFT format)
    version: int = 0  # 0: the warm start or the base model; n: after the learner's n-th update
    kind: str = "lora"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown weights kind {self.kind!r} (known: {', '.join(KINDS)})")
        object.__setattr__(self, "path", str(self.path))  # a Path is accepted; the record stays plain
