"""Checkpoints: everything needed to continue a run exactly, written so a kill never leaves a
half-written one.

RUN/checkpoints/it00012/ holds the adapter (PEFT, safetensors; under full fine-tuning every weight), the optimizer state, the RNG
states, the task sampler's state and the iteration counter. It is written to a temporary
directory, fsynced, renamed into place, and only then named in RUN/checkpoints/latest (an
atomic one-line file). Older checkpoints are removed after that, so at every moment the one
`latest` names is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agentrl import faults
from agentrl.errors import RunError, UserError
from agentrl.io import atomic_path, atomic_write_text
from agentrl.train.handoff import Learner

STATE = "state.json"
TENSORS = "state.safetensors"


@dataclass
class TrainState:
    """What the loop carries from one iteration to the next (besides the learner's weights)."""

    iteration: int = 0  # last completed iteration (0: none yet)
    adapter_version: int = 0
    elapsed_s: float = 0.0  # cumulative wall-clock of the run, eval included, across resumes
    bad_updates: int = 0  # non-finite losses/gradients in a row
    task_rng: dict | None = None  # numpy bit generator state of the task sampler
    select: dict | None = None  # the selection stages' state (GRESO streaks and p, ...)


def _split_tensors(obj, path: str = ""):
    """(obj with every tensor replaced by {"__tensor__": key}, {key: tensor})."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": path}, {path: obj.detach().cpu().contiguous()}
    tensors = {}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[k], more = _split_tensors(v, f"{path}.{k}" if path else str(k))
            tensors |= more
        return out, tensors
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            item, more = _split_tensors(v, f"{path}.{i}")
            out.append(item)
            tensors |= more
        return out, tensors
    return obj, tensors


def _join_tensors(obj, tensors: dict):
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run: Path, state, learner: Learner, name: str | None = None, resume: str | None = None) -> Path:
    """Write checkpoint `name` (default `it{iteration}`) atomically and point `latest` at it;
    return its path. `state`: a dataclass (TrainState, or sft's SftState); `resume`: the command
    that continues the run (named when the disk refuses a checkpoint)."""
    root = run / "checkpoints"
    final = root / (name or f"it{state.iteration:05d}")
    try:
        with atomic_path(final) as tmp:  # a previous attempt at this iteration that never became `latest` is replaced
            learner.save_state(tmp)  # adapter, optimizer, RNG (the learner may live in another process)
            fields, tensors = _split_tensors(asdict(state))  # a stage's weights (ARRoL's head) go to safetensors
            (tmp / STATE).write_text(json.dumps(fields))
            if tensors:
                save_file(tensors, str(tmp / TENSORS))
            _fsync_tree(tmp)
            faults.point("checkpoint")
        faults.point("latest")
        atomic_write_text(root / "latest", final.name + "\n")
    except BaseException as e:
        if isinstance(e, OSError):  # disk full, quota, permissions: the previous checkpoint is untouched
            previous = latest(run)
            raise RunError(f"cannot write checkpoint {final.name}: {e.strerror or e}; the run keeps "
                           f"{previous.name if previous else 'no checkpoint'}: fix it, then "
                           f"`{resume or f'agentrl train --resume {run}'}`") from None
        raise
    for old in root.iterdir():  # only now: `latest` already names the new one
        if old != final and old.name != "latest":
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return final


def clean_partial(run: Path) -> None:
    """Remove what a killed run left half-written: temporary checkpoint and adapter directories,
    and a renamed checkpoint that `latest` never named (it is redone)."""
    named = latest(run)
    for root in (run / "checkpoints", run / "adapters"):
        for path in root.glob(".*") if root.is_dir() else ():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for path in (run / "checkpoints").glob("it*"):
        if named is None or path.name > named.name:
            shutil.rmtree(path, ignore_errors=True)


def latest(run: Path) -> Path | None:
    """The checkpoint `latest` names; None if the run has none yet."""
    pointer = run / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run / "checkpoints" / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise UserError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load(path: Path, learner: Learner, state_type=TrainState) -> tuple:
    """Restore the learner's adapter weights, optimizer and RNG; return the loop state (a
    `state_type`) and the weights the learner now holds (the sampler serves them from the resumed
    run's first rollout)."""
    try:
        state = read_state(path, state_type)
        weights = learner.load_state(path, state.adapter_version)  # safetensors + torch.load(weights_only=True): no code runs
    except UserError:
        raise
    except Exception as e:  # damaged, truncated, or a pickle that is more than weights
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise UserError(f"cannot load checkpoint {path}: {e.__class__.__name__}: {first}") from None
    return state, weights


def read_state(path: Path, state_type=TrainState):
    """The loop state of checkpoint `path` alone (no weights loaded)."""
    fields = json.loads((path / STATE).read_text())
    if (path / TENSORS).is_file():
        fields = _join_tensors(fields, load_file(str(path / TENSORS)))
    return state_type(**fields)
