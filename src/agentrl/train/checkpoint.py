"""Checkpoints: everything needed to continue a run exactly, written so a kill never leaves a
half-written one.

RUN/checkpoints/it00012/ holds the adapter (PEFT, safetensors), the optimizer state, the RNG
states, the task sampler's state and the iteration counter. It is written to a temporary
directory, fsynced, renamed into place, and only then named in RUN/checkpoints/latest (an
atomic one-line file). Older checkpoints are removed after that, so at every moment the one
`latest` names is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from agentrl.errors import UserError
from agentrl.io import atomic_write_text

STATE = "state.json"


@dataclass
class TrainState:
    """What the loop carries from one iteration to the next (besides the learner's weights)."""

    iteration: int = 0  # last completed iteration (0: none yet)
    adapter_version: int = 0
    elapsed_s: float = 0.0  # cumulative wall-clock of the run, eval included, across resumes
    bad_updates: int = 0  # non-finite losses/gradients in a row
    task_rng: dict | None = None  # numpy bit generator state of the task sampler


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


def save(run: Path, state: TrainState, learner) -> Path:
    """Write checkpoint `it{iteration}` atomically and point `latest` at it; return its path."""
    root = run / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"it{state.iteration:05d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}-"))
    try:
        learner.save_state(tmp)  # adapter, optimizer, RNG (the learner may live in another process)
        (tmp / STATE).write_text(json.dumps(asdict(state)))
        _fsync_tree(tmp)
        if final.exists():  # a previous attempt at this iteration that never became `latest`
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "latest", final.name + "\n")
    for old in root.iterdir():  # only now: `latest` already names the new one
        if old != final and old.name != "latest":
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return final


def latest(run: Path) -> Path | None:
    """The checkpoint `latest` names; None if the run has none yet."""
    pointer = run / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run / "checkpoints" / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise UserError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load(path: Path, learner) -> TrainState:
    """Restore the learner's adapter weights, optimizer and RNG; return the loop state."""
    state = TrainState(**json.loads((path / STATE).read_text()))
    learner.load_state(path, state.adapter_version)
    return state
