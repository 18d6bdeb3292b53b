"""`WeightsRef`: the one plain record of which weights a sampler should serve.

The learner hands it out after an update (`save`), the loop hands it to the generator
(`load`), checkpoints and the learner processes pass it across their boundaries. Today it
names a PEFT LoRA adapter directory (`kind="lora"`) or, under full fine-tuning (learner.lora_r
0), a model directory holding every weight (`kind="full"`: config.json + model.safetensors, as
transformers' `save_pretrained` writes it), and its version.

Contract: the directory a ref names is complete when the ref exists (written atomically) and
is never changed afterwards; a sampler that loads a ref serves exactly those weights from its
next generate on (an in-place swap: the base model stays resident), and tags its completions
with `version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import UserError
from agentrl.io import file_sha256

KINDS = ("lora", "full")
FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards and their index


def weights_kind(path) -> str:
    """What a weights directory holds, read from its files: adapter_config.json = a LoRA adapter;
    config.json + model.safetensors (or a sharded index) = every weight of the model ("full")."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"weights directory not found: {p} (a LoRA adapter or a full model directory)")
    if (p / "adapter_config.json").is_file():
        return "lora"
    if (p / "config.json").is_file() and any((p / f).is_file() for f in FULL_WEIGHTS):
        return "full"
    raise UserError(f"{p} is not a PEFT adapter (no adapter_config.json) nor a full model directory "
                    "(config.json + model.safetensors)")


def weights_digest(path) -> dict[str, str]:
    """The sha256 of each weight file a weights directory holds, as `sha256sum` prints it
    (adapter_model.safetensors; or model.safetensors, or a sharded model's index and shards): an
    eval's summary.json names the bytes it evaluated, so two results pair on the same weights
    only where these agree (the same recipe on another CPU gives other bytes)."""
    p = Path(path)
    names = ["adapter_model.safetensors"] if weights_kind(p) == "lora" else [
        *(f for f in FULL_WEIGHTS if (p / f).is_file()), *sorted(f.name for f in p.glob("model-*.safetensors"))]
    return {name: file_sha256(p / name) for name in names}


@dataclass(frozen=True)
class WeightsRef:
    path: str  # the adapter directory (PEFT format), or the model directory (kind "full")
    version: int = 0  # 0: the warm start or the base model; n: after the learner's n-th update
    kind: str = "lora"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown weights kind {self.kind!r} (known: {', '.join(KINDS)})")
        object.__setattr__(self, "path", str(self.path))  # a Path is accepted; the record stays plain

    @classmethod
    def of(cls, path, version: int = 0) -> WeightsRef:
        """The ref of a directory whose kind is read from its files (`weights_kind`): a warm start or
        `--adapter DIR` may be either."""
        return cls(path, version, weights_kind(path))


def refuse_full_init(lora_r: int, init_adapter: str | None) -> None:
    """A LoRA learner (lora_r > 0) continues a LoRA adapter, never a full model directory."""
    if lora_r and init_adapter and weights_kind(init_adapter) == "full":
        raise UserError(f"learner.lora_r {lora_r} trains a LoRA over the base model, but {init_adapter} holds every "
                        f"weight (full fine-tuning): continue it with learner.lora_r 0, or make it the base model "
                        f"(--model {init_adapter})")
