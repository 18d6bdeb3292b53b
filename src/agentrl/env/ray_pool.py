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

from agentrl.env.data import Game
from agentrl.env.pool import EnvFailure, Pending, _Batches


class EnvActor:
    """Holds the envs of its games; `run` is one request (the body of a local pool worker)."""

    def __init__(self, kind: str):
        from agentrl.env import env_factory

        self.make_env, self.envs = env_factory(kind), {}
        if kind == "alfworld":
            from agentrl.env.alfworld import warm_up

            warm_up()

    def run(self, op: str, batch: list) -> list:
        from agentrl.env.pool import apply_batch

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
        self._owner: dict[int, int] = {}  # env handle -> actor index
        self._by_game: dict[str, int] = {}
        self.replaced = 0

    def _start(self):
        return self._actor_class.remote(self.kind)

    def _actor_for(self, game: Game) -> int:
        if game.game_id not in self._by_game:
            self._by_game[game.game_id] = len(self._by_game) % len(self._actors)
        return self._by_game[game.game_id]

    def submit(self, op: str, items: list[tuple[int, object]]) -> Pending:
        if op == "reset":
            for handle, game in items:
                self._owner[handle] = self._actor_for(game)
        pending = Pending(op, [EnvFailure("env lost with its actor")] * len(items))
        for i, (handle, _) in enumerate(items):
            if handle in self._owner:
                pending.shares.setdefault(self._owner[handle], []).append(i)
        if op == "release":
            for handle, _ in items:
                self._owner.pop(handle, None)
        for a, idx in pending.shares.items():
            pending.refs[a] = (self._generation[a], self._actors[a].run.remote(op, [items[i] for i in idx]))
            pending.waiting.add(a)
        return pending

    def collect(self, pending: Pending) -> list:
        """Wait for every answer to `pending`; an actor that died or hung fails its share and is replaced."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + self.timeout_s
        for a in sorted(pending.waiting):
            generation, ref = pending.refs[a]
            try:
                answer = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (GetTimeoutError, RayActorError) as e:
                hung = isinstance(e, GetTimeoutError)
                why = f"did not answer within {self.timeout_s:g}s" if hung else "died"
                for i in pending.shares[a]:
                    pending.out[i] = EnvFailure(f"env actor {why} during {pending.op}")
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
        self.replaced += 1
        for handle in [h for h, owner in self._owner.items() if owner == a]:
            del self._owner[handle]

    def ready(self) -> float:
        """Wait until every actor answers (its imports are done); the seconds waited."""
        import ray

        t0 = time.perf_counter()
        ray.get([actor.run.remote("ping", []) for actor in self._actors], timeout=self.timeout_s)
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
