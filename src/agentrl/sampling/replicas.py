"""Sampler replicas on a Ray cluster (`sampling.replicas N`, `--sampler-replicas N`).

N Ray actors, each one sampler (hf or vLLM) on its own GPU (on CPU without one). Each lockstep
step's batch is split by group: all rows of a task go to the same replica (so its prefix cache
is reused), tasks are spread round-robin as they first appear. Rows carry their own seeds, so
the samples do not depend on the split: N replicas give the trajectories one sampler gives.
A hot-swap (`load`) sends the adapter's bytes through the object store once; every replica writes them
to its own disk, loads them and reports the version it now serves, which must be the new one.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from agentrl import cluster, sampling  # sampling.make_sampler looked up at call time, as the generator does
from agentrl.errors import RunError, UserError
from agentrl.io import read_tree, write_tree
from agentrl.sampling.base import Completion, GenRequest, SamplingParams
from agentrl.weights import WeightsRef

log = logging.getLogger(__name__)


class SamplerReplica:
    """One replica (a Ray actor): the backend `make_sampler` builds, on the actor's device."""

    def __init__(self, cfg, colocated: bool = False, gpus: int = 0):
        import dataclasses

        device = "cuda" if gpus and str(cfg.model.device).startswith("cuda") else cfg.model.device  # Ray shows it one GPU
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device),
                                  sampling=dataclasses.replace(cfg.sampling, replicas=1))
        self.sampler = sampling.make_sampler(cfg, colocated=colocated)
        self.adapter_dir: str | None = None

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        return self.sampler.generate(requests, params)

    def load(self, files: dict[str, bytes], weights: WeightsRef) -> int | None:
        """Write the adapter's bytes to this node's disk and serve them as `weights.version`."""
        path = write_tree(files, tempfile.mkdtemp(prefix=f"agentrl-adapter-v{weights.version}-"))
        try:
            self.sampler.load(WeightsRef(str(path), weights.version, weights.kind))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # a failed load changes nothing, on disk either
            raise
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter_dir = str(path)
        return self.serving()

    def serving(self) -> int | None:
        return self.sampler.adapter_version

    def sleep(self) -> None:
        self.sampler.sleep()

    def release(self, keys) -> None:
        self.sampler.release(keys)

    def close(self) -> None:
        """The copy of the adapter this node serves goes with the replica (a full-weights version is
        ~0.5 GB of the node's temp disk)."""
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
            self.adapter_dir = None
        self.sampler.close()

    def describe(self) -> dict:
        import os

        import ray

        return {"tokenizer": self.sampler.tokenizer, "max_model_len": self.sampler.max_model_len,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def replica_gpus(cfg, cluster_gpus: float) -> int:
    """GPUs one replica holds: 1 for vLLM or a CUDA device, or on `auto` when the cluster has GPUs."""
    device = str(cfg.model.device)
    if cfg.sampling.backend == "vllm" or device.startswith("cuda"):
        return 1
    return 1 if device == "auto" and cluster_gpus >= 1 else 0


class ReplicatedSampler:
    """The Sampler protocol over N replica actors."""

    def __init__(self, cfg, colocated: bool = False):
        import ray

        n = cfg.sampling.replicas
        gpus = replica_gpus(cfg, cluster.resources().get("GPU", 0))
        check_replicas(cfg)
        actor = ray.remote(SamplerReplica).options(num_cpus=1, num_gpus=gpus)
        self.replicas = [actor.remote(cfg, colocated, gpus) for _ in range(n)]
        try:
            info = ray.get([r.describe.remote() for r in self.replicas])
        except ray.exceptions.RayActorError as e:
            raise RunError(f"a sampler replica failed to start: {e}") from None
        self.tokenizer, self.max_model_len = info[0]["tokenizer"], info[0]["max_model_len"]
        self.placement = [(i["node"], i["pid"]) for i in info]
        self.adapter_version: int | None = None
        self._replica_of: dict = {}  # task (game id) -> replica index

    def _replica(self, key, row: int) -> int:
        task = key[0] if isinstance(key, (tuple, list)) else key
        if task is None:
            return row % len(self.replicas)
        if task not in self._replica_of:
            self._replica_of[task] = len(self._replica_of) % len(self.replicas)
        return self._replica_of[task]

    @property
    def model(self) -> None:
        """The weights live in the replica actors."""
        return None

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        share: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            share.setdefault(self._replica(req.key, i), []).append(i)
        calls = {r: self.replicas[r].generate.remote([requests[i] for i in rows], params) for r, rows in share.items()}
        out: list[Completion | None] = [None] * len(requests)
        for r, ref in calls.items():
            for i, c in zip(share[r], self._get(ref, "generate")):
                out[i] = c
        return out

    def _get(self, ref, what: str):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise RunError(f"a sampler replica died during {what}: {str(e).splitlines()[0]}") from None

    def load(self, weights: WeightsRef) -> None:
        import ray

        files = ray.put(read_tree(weights.path))
        served = self._get([r.load.remote(files, weights) for r in self.replicas], "load")
        if any(v != weights.version for v in served):
            raise RunError(f"after the swap to v{weights.version} the sampler replicas serve versions {served}")
        self.adapter_version = weights.version

    def served_versions(self) -> list[int | None]:
        return self._get([r.serving.remote() for r in self.replicas], "serving")

    def sleep(self) -> None:
        self._get([r.sleep.remote() for r in self.replicas], "sleep")

    def reserve(self, rows: int, tokens_per_row: int) -> None:
        """Each replica's sampler grows its own store with the rows it serves."""

    def kv_memory(self) -> None:
        """Each replica holds its own KV memory."""
        return None

    def rows_that_fit(self, tokens_per_row: int) -> None:
        """Each replica holds its own KV memory; the split by task decides the rows each gets."""
        return None

    def release(self, keys) -> None:
        share: dict[int, list] = {}
        for key in keys:  # each key lives on the replica its task was given to
            share.setdefault(self._replica(key, 0), []).append(key)
        self._get([self.replicas[r].release.remote(ks) for r, ks in share.items()], "release")

    def close(self) -> None:
        """Kill the replica actors (they hold their GPUs until then), each first deleting its copy of
        the adapter (a replica that does not answer in 30 s, or is gone, is killed as it is)."""
        import ray

        try:
            ray.get([r.close.remote() for r in self.replicas], timeout=30)
        except Exception as e:  # a dead or hung replica: nothing more to do for it
            log.warning("a sampler replica did not close cleanly (%s); its adapter copy may stay in its temp folder",
                        str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        for r in self.replicas:
            ray.kill(r, no_restart=True)
        self.replicas = []


def check_replicas(cfg) -> None:
    """Refuse, with one line, more GPU replicas than the cluster has GPUs (call once connected)."""
    gpus = cluster.resources().get("GPU", 0)
    if replica_gpus(cfg, gpus) and cfg.sampling.replicas > gpus:
        raise UserError(f"sampling.replicas {cfg.sampling.replicas} needs {cfg.sampling.replicas} GPUs (one per replica); "
                        f"the cluster has {int(gpus)}")
