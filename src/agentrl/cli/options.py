"""The options the commands share, each declared once, and the config overrides built from them.

An option that sets a config field carries its dotted path (`To`) in its annotation; a command
turns the values it was given into load_config's overrides with `overrides(command, values)`, so a
new flag is one declaration: here when several commands take it, at its command when one does."""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, get_type_hints

import typer


@dataclass(frozen=True)
class To:
    """The config field an option sets (`convert` maps the parsed value; None: not given)."""

    path: str
    convert: Callable[[Any], Any] = lambda v: v


def opt(kind: Any, path: str | None, help: str, *decls: str, **kwargs) -> Any:
    """An option of type `kind` setting config field `path` (None: a command argument, no field)."""
    option = typer.Option(*decls, help=help, **kwargs)
    return Annotated[kind, option] if path is None else Annotated[kind, option, To(path)]


def overrides(command: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """{config path: value} of the options of `command` that set a config field, in its --help order."""
    out = {}
    for name, hint in get_type_hints(command, include_extras=True).items():
        for to in getattr(hint, "__metadata__", ()):
            if isinstance(to, To):
                out[to.path] = to.convert(values[name])
    return out


def _workers_value(value: str | None) -> int | str | None:
    """--env-workers N | auto: a number becomes an int; anything else is checked by the config."""
    return int(value) if value is not None and value.strip().isdigit() else value


def _budget_value(value: str | None) -> float | str | None:
    """--kv-budget-gb auto | GB: a number becomes a float; anything else is checked by the config."""
    try:
        return float(value) if value is not None and value != "auto" else value
    except ValueError:
        return value


OptInt, OptFloat, OptStr, OptBool = Optional[int], Optional[float], Optional[str], Optional[bool]

ConfigOpt = opt(Optional[Path], None, "YAML config (see configs/).", "--config", "-c")
ModelOpt = opt(OptStr, "model.name", "'default', a local HF model directory, or a hub id.")
AdapterOpt = opt(OptStr, "model.adapter", "PEFT adapter directory to apply, or full weights (a model directory from learner.lora_r 0).")
MaxNewTokensOpt = opt(OptInt, "sampling.max_new_tokens", "Token budget of one reply.")
LoraROpt = opt(OptInt, "learner.lora_r", "LoRA rank the learner trains (0: full fine-tuning, every weight, fp32 master weights).")
SamplerOpt = opt(OptStr, "sampling.backend", "Sampler backend: hf (transformers, CPU or GPU) | vllm (GPU, LoRA hot-swap).")
ActionSpaceOpt = opt(OptStr, "sampling.action_space",
                     "What a reply may be: free (text; its Action: line fuzzy-matched to an admissible command) | "
                     "admissible (constrained decoding: exactly one of the step's admissible commands; needs prompt.reply action).",
                     "--action-space")
LoopGuardOpt = opt(OptInt, "sampling.loop_guard",
                   "With --action-space admissible: a reply may not go round a cycle of up to N commands a second time "
                   "in a row (those commands leave the step's choice; 1: never the previous command again). 0: off.",
                   "--loop-guard")
EnvWorkersOpt = opt(OptStr, "env.workers", "Env worker processes: auto (one per core, the default) | N | 0 (envs in the main process).",
                    callback=_workers_value)
RayAddressOpt = opt(OptStr, "cluster.ray_address",
                    "Run on Ray: local (start Ray here) | auto (join this machine's cluster) | HOST:PORT; env workers become actors.")
SamplerReplicasOpt = opt(OptInt, "sampling.replicas", "Samplers, each a Ray actor on its own GPU (needs --ray-address).")
KVBudgetOpt = opt(OptStr, "sampling.kv_budget_gb",
                  "The hf sampler's KV cache budget in GB, or auto (free memory less 3 GB); runs expected to need more are refused.",
                  callback=_budget_value)
DataOpt = opt(OptStr, "data.root", "ALFWorld data root (default: $ALFWORLD_DATA, then ~/.cache/alfworld).", "--data")
GroupSizeOpt = opt(OptInt, "rollout.group_size", "G: trajectories per task.", "--group-size", "-G")
GateOrTauOpt = opt(OptFloat, "rollout.gate_or_tau", "OR-rule: also cut when >= this share finished by K.")
GateWarmupOpt = opt(OptStr, "gate.warmup", "An auto gate's first labels: groups.csv of an earlier ungated rollout of the same adapter (--gate off), read at its K.", "--gate-warmup")

# Removed flags, per command: each answers with one line naming its replacement (exit 2), see cli.main.
REMOVED_FLAGS = {"train": {
    "--dapo-filter": "--select cut,dapo (the gate and the filter; without the gate, --select dapo)",
    "--no-dapo-filter": "--select without dapo",
    "--colocate": "--layout colocate",
}}
