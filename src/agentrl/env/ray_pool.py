"""Env workers as Ray actors: the env pool of a cluster (`--ray-address`).

The same interface as `EnvPool` (submit / collect / release in batches, results in the caller's
order, overlap with generation), so the lockstep runner does not know where its envs live. One
actor per CPU slot (one CPU each, spread over the nodes); the envs of one game go to one actor,
so they share its game caches; groups are spread round-robin. An actor that dies or does not
answer within `env.worker_timeout_s` ends only its trajectories (EnvFailure -> env_error) and
is replaced; the run goes on, as with the local pool.

Requests to one actor run in the order they were sent (Ray runs a caller's calls to a
synchronous actor in submission order), which is what the runner's waves rely on.
"""

from __future__ import annotations

import time

from agentrl.env import env_factory
from agentrl.env.alfworld import warm_up
from agentrl.env.pool import EnvFailure, Pending, _Batches, apply_batch, share


class EnvActor:
    """Holds the envs of its games; `run` is one request (the body of a local pool worker)."""

    def __init__(self, kind: str):
        self.make_env, self.envs = env_factory(kind), {}
        if kind == "alfworld":
            warm_up()

    def run(self, op: str, batch: list) -> list:
        return apply_batch(self.envs, self.make_env, op, batch)

    def where(self) -> tuple[str, int]:
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RayEnvPool(_Batches):
    def __init__(self, workers: int, kind: str = "alfworld", timeout_s: float = 120.0, overlap: bool = True):
        import ray

        if workers < 1:
            raise ValueError("an env pool needs at least one actor")
        self.kind, self.timeout_s, self.overlap = kind, timeout_s, overlap
        self._actor_class = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(EnvActor)
        self._actors = [self._start() for _ in range(workers)]
        self._generation = [0] * workers  # bumped when an actor is replaced
        self._started = [False] * workers  # answered once: until then its start-up (imports, placement) may take longer
        self.start_timeout_s = max(600.0, timeout_s)
        self._owner: dict[int, int] = {}  # env handle -> actor index
        self._by_game: dict[str, int] = {}
        self.replaced = 0

    def _start(self):
        return self._actor_class.remote(self.kind)

    def submit(self, op: str, items: list[tuple[int, object]]) -> Pending:
        pending = share(self, op, items, len(self._actors), "actor")
        for a, idx in pending.shares.items():
            pending.refs[a] = (self._generation[a], self._actors[a].run.remote(op, [items[i] for i in idx]))
            pending.waiting.add(a)
        return pending

    def collect(self, pending: Pending) -> list:
        """Wait for every answer to `pending`; an actor that died or hung fails its share and is replaced."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        t0 = time.monotonic()
        for a in sorted(pending.waiting):
            generation, ref = pending.refs[a]
            limit = self.timeout_s if self._started[a] else self.start_timeout_s
            try:
                answer = ray.get(ref, timeout=max(0.0, t0 + limit - time.monotonic()))
                self._started[a] = self._started[a] or self._generation[a] == generation
            except (GetTimeoutError, RayActorError) as e:
                hung = isinstance(e, GetTimeoutError)
                why = f"did not answer within {limit:g}s" if hung else "died"
                for i in pending.shares[a]:
                    pending.out[i] = EnvFailure(f"env actor {why} during {pending.op}", worker_lost=True)
                if self._generation[a] == generation:  # not replaced yet by an earlier request's failure
                    self._replace(a)
            else:
                for i, result in zip(pending.shares[a], answer):
                    pending.out[i] = result
            pending.waiting.discard(a)
        return pending.out

    def _replace(self, a: int) -> None:
        import ray

        ray.kill(self._actors[a], no_restart=True)
        self._actors[a] = self._start()
        self._generation[a] += 1
        self._started[a] = False
        self.replaced += 1
        for handle in [h for h, owner in self._owner.items() if owner == a]:
            del self._owner[handle]

    def ready(self) -> float:
        """Wait until every actor answers (its imports are done); the seconds waited."""
        import ray

        t0 = time.perf_counter()
        ray.get([actor.run.remote("ping", []) for actor in self._actors], timeout=self.start_timeout_s)
        self._started = [True] * len(self._actors)
        return time.perf_counter() - t0

    def placement(self) -> list[tuple[str, int]]:
        """(node id, pid) of every actor."""
        import ray

        return ray.get([actor.where.remote() for actor in self._actors])

    @property
    def workers(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        return list(self._actors)

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            try:  # releases still in flight are dropped with the actor: its envs go with it
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []

    def __enter__(self) -> "RayEnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
