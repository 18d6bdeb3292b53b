"""The learner as a Ray actor (`agentrl train --ray-address ...`): it implements the `Learner`
protocol (handoff.py) like the learner process of the two-device layout (remote.py). Its GPU
(when it trains on one) is reserved through a placement group. Weights and checkpoint states
travel as bytes through the object store (`PackedWeights`, `read_tree`) and are written by the
driver into the run directory, so checkpoints and `--resume` work unchanged whichever node the
actor runs on. A dead actor is noticed at the next call: LearnerDied, and the run keeps its last
complete iteration.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from agentrl import cluster
from agentrl.errors import UserError
from agentrl.io import read_tree, write_tree
from agentrl.train.handoff import STATE_WEIGHTS, LearnerDied, PackedWeights, from_train_items, train_items
from agentrl.train.learner import build_learner
from agentrl.weights import WeightsRef


class LearnerActor:
    def __init__(self, cfg, gpus: int):
        device = "cuda" if gpus else "cpu"  # Ray shows the actor only its own GPU
        cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, device=device))
        self.learner = build_learner(cfg)

    def update(self, items):
        return self.learner.update(from_train_items(items))

    def save(self) -> PackedWeights:
        root = Path(tempfile.mkdtemp(prefix="agentrl-learner-"))
        try:
            return PackedWeights.pack(self.learner.save(root))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def save_state(self) -> dict:
        root = Path(tempfile.mkdtemp(prefix="agentrl-state-"))
        try:
            self.learner.save_state(root)
            return read_tree(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def load_state(self, files: dict, version: int) -> None:
        root = write_tree(files, tempfile.mkdtemp(prefix="agentrl-state-"))
        try:
            self.learner.load_state(root, version)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def pid(self) -> int:
        return os.getpid()


def learner_gpus(cfg, cluster_gpus: float) -> int:
    device = str(cfg.learner.device or cfg.model.device)
    if device.startswith("cuda"):
        return 1
    return 1 if device == "auto" and cluster_gpus >= 1 else 0


class RayLearner:
    def __init__(self, cfg):
        # Ray is an optional dependency (agentrl[ray]): imported only when a Ray learner is made
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = learner_gpus(cfg, cluster.resources().get("GPU", 0))
        if gpus > cluster.resources().get("GPU", 0):
            raise UserError("the learner trains on a GPU but the Ray cluster has none")
        self.group = placement_group([{"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}])
        ray.get(self.group.ready(), timeout=600)
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group)
        self.actor = ray.remote(LearnerActor).options(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy,
                                                      max_restarts=0).remote(cfg, gpus)
        self.version = 0
        self.pid = self._call(self.actor.pid.remote(), "start-up")

    def _call(self, ref, what: str):
        import ray  # optional dependency (see __init__)

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise LearnerDied(f"the learner actor died during {what} ({str(e).strip().splitlines()[0]})") from None
        except ray.exceptions.RayTaskError as e:  # the learner raised: its own message, one line
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise cause from None

    def update(self, batch):
        return self._call(self.actor.update.remote(train_items(batch)), "update")

    def save(self, root: Path) -> WeightsRef:
        """Written here by the driver as root/v{n}, atomically."""
        ref = self._call(self.actor.save.remote(), "save").unpack(root)
        self.version = ref.version
        return ref

    def save_state(self, path: Path) -> None:
        write_tree(self._call(self.actor.save_state.remote(), "save_state"), path)

    def load_state(self, path: Path, version: int) -> WeightsRef:
        self._call(self.actor.load_state.remote(read_tree(path), version), "load_state")
        self.version = version
        return WeightsRef.of(path / STATE_WEIGHTS, version)  # LoRA or full weights, as the actor wrote them

    def close(self) -> None:
        import ray  # optional dependency (see __init__)
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(self.actor, no_restart=True)
        finally:
            remove_placement_group(self.group)
