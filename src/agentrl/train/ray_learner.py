"""The learner as a Ray actor (`agentrl train --ray-address ...`): the same interface as the
learner process of the two-device layout (remote.py; what they share is in handoff.py): update, save_adapter, save_state,
load_state, version, close. Its GPU (when it trains on one) is reserved through a placement
group. Adapters and checkpoint states travel as bytes through the object store and are written
by the driver into the run directory, so checkpoints and `--resume` work unchanged whichever
node the actor runs on. A dead actor is noticed at the next call: LearnerDied, and the run keeps
its last complete iteration.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from agentrl.config import effective_prompt
from agentrl.train.handoff import LearnerDied, TrainItem, train_items


class LearnerActor:
    def __init__(self, cfg, gpus: int):
        import dataclasses

        from agentrl.models import load_model
        from agentrl.train.learner import Learner

        device = "cuda" if gpus else "cpu"  # Ray shows the actor only its own GPU
        cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, device=device))
        model = load_model(cfg.model.name, cfg.model.dtype, device, cfg.model.trust_remote_code)[0]
        self.learner = Learner(model, cfg.learner, seed=cfg.seed, init_adapter=cfg.train.init_adapter,
                               prompt=effective_prompt(cfg))

    def update(self, items):
        return self.learner.update([(TrainItem(*item), adv) for item, adv in items])

    def save_adapter(self) -> tuple[dict, int]:
        from agentrl.io import read_tree

        root = Path(tempfile.mkdtemp(prefix="agentrl-learner-"))
        try:
            return read_tree(self.learner.save_adapter(root)), self.learner.version
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def save_state(self) -> dict:
        from agentrl.io import read_tree

        root = Path(tempfile.mkdtemp(prefix="agentrl-state-"))
        try:
            self.learner.save_state(root)
            return read_tree(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def load_state(self, files: dict, version: int) -> None:
        from agentrl.io import write_tree

        root = write_tree(files, tempfile.mkdtemp(prefix="agentrl-state-"))
        try:
            self.learner.load_state(root, version)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def pid(self) -> int:
        import os

        return os.getpid()


def learner_gpus(cfg, cluster_gpus: float) -> int:
    device = str(cfg.learner.device or cfg.model.device)
    if device.startswith("cuda"):
        return 1
    return 1 if device == "auto" and cluster_gpus >= 1 else 0


class RayLearner:
    def __init__(self, cfg):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from agentrl import cluster
        from agentrl.errors import UserError

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
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise LearnerDied(f"the learner actor died during {what} ({str(e).strip().splitlines()[0]})") from None
        except ray.exceptions.RayTaskError as e:  # the learner raised: its own message, one line
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise cause from None

    def update(self, batch):
        return self._call(self.actor.update.remote(train_items(batch)), "update")

    def save_adapter(self, root: Path) -> Path:
        """Written here by the driver as root/v{n}, atomically (temp dir, then rename)."""
        from agentrl.io import write_tree

        files, self.version = self._call(self.actor.save_adapter.remote(), "save_adapter")
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{self.version}"
        tmp = write_tree(files, tempfile.mkdtemp(dir=root, prefix=f".v{self.version}-"))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def save_state(self, path: Path) -> None:
        from agentrl.io import write_tree

        write_tree(self._call(self.actor.save_state.remote(), "save_state"), path)

    def load_state(self, path: Path, version: int) -> None:
        from agentrl.io import read_tree

        self._call(self.actor.load_state.remote(read_tree(path), version), "load_state")
        self.version = version

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(self.actor, no_restart=True)
        finally:
            remove_placement_group(self.group)
