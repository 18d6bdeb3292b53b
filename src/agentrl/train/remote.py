"""The learner in its own process: the two-device layout.

The sampler stays in the main process on its device; the learner lives in a spawned process
on its own device (`--learner-device cuda:1`). The main process sends training batches as
plain token ids, masks, sampler log-probs and advantages, and gets back the update's metrics
and the new adapter version, written to the run's versioned adapter directory; the sampler
then hot-swaps it. Checkpoint state is written and read by the learner process itself.

`RemoteLearner` implements the `Learner` protocol (handoff.py), so the loop does not know which
layout it drives; the `WeightsRef` a save returns crosses the pipe as it is (the run directory
is on this machine). If the learner process dies, the next call raises `LearnerDied` at once (we
poll the process while waiting) instead of hanging; the run is resumable from its last checkpoint.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from agentrl.errors import UserError
from agentrl.train.handoff import Learner, LearnerDied, TrainItem, from_train_items, train_items
from agentrl.train.learner import build_learner
from agentrl.train.ray_learner import RayLearner  # imports Ray itself only when one is made (--ray-address)
from agentrl.weights import WeightsRef

__all__ = ["Learner", "LearnerDied", "RemoteLearner", "TrainItem", "make_learner", "resolve_layout", "train_items"]


def resolve_layout(cfg) -> str:
    """colocate | split for this config (auto: split only when the learner has its own CUDA device)."""
    layout = cfg.train.layout
    if layout != "auto":
        return layout
    learner_device = cfg.learner.device
    if learner_device and learner_device.startswith("cuda") and learner_device != cfg.model.device:
        return "split"
    return "colocate"


def make_learner(cfg) -> Learner:
    """The learner for cfg's layout: in this process, or in its own; on a Ray cluster, an actor."""
    if cfg.cluster.ray_address:
        return RayLearner(cfg)
    if resolve_layout(cfg) == "split":
        return RemoteLearner(cfg)
    return build_learner(cfg)


def _serve(conn, cfg) -> None:
    """The learner process: load the model on its device, then answer requests until 'close'."""
    try:
        learner = build_learner(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the main process as one line
        conn.send(("error", f"{e.__class__.__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        op, args = conn.recv()
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            if op == "update":
                result = learner.update(from_train_items(args))
            elif op == "save":
                result = learner.save(Path(args))
            elif op == "save_state":
                result = learner.save_state(Path(args))
            elif op == "load_state":
                result = learner.load_state(Path(args[0]), args[1])
            elif op == "pid":
                result = os.getpid()
            else:
                raise ValueError(f"unknown request {op!r}")
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{e.__class__.__name__}: {e}"))
        else:
            conn.send(("ok", result))


class RemoteLearner:
    def __init__(self, cfg, start_timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")  # a fresh interpreter: its own CUDA context and device
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, cfg), name="agentrl-learner", daemon=True)
        self.process.start()
        child.close()
        self.version = 0
        self._call(None, None, timeout_s=start_timeout_s)  # wait until the model is loaded

    @property
    def pid(self) -> int:
        return self.process.pid

    def _call(self, op: str | None, args, timeout_s: float | None = None):
        what = op or "start-up"
        try:
            if op is not None:
                self._conn.send((op, args))
            start = time.monotonic()
            while not self._conn.poll(0.2):
                if not self.process.is_alive():
                    raise EOFError
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise LearnerDied(f"the learner process (pid {self.pid}) did not answer {what} within {timeout_s:.0f}s")
            status, result = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self.process.join(timeout=5)
            raise LearnerDied(f"the learner process (pid {self.pid}) died during {what} "
                              f"(exit code {self.process.exitcode})") from None
        if status == "error":
            raise UserError(f"learner process: {result}")
        return result

    def update(self, batch):
        return self._call("update", train_items(batch))

    def save(self, root: Path) -> WeightsRef:
        ref = self._call("save", str(root))
        self.version = ref.version
        return ref

    def save_state(self, path: Path) -> None:
        self._call("save_state", str(path))

    def load_state(self, path: Path, version: int) -> WeightsRef:
        ref = self._call("load_state", (str(path), version))
        self.version = version
        return ref

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("close", None, timeout_s=30)
            except UserError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
