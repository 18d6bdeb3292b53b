"""Env work off the main process: ALFWorld envs live in worker processes.

An `EnvPool` keeps N spawned workers. Envs of one game go to the same worker (it then reuses
the game's cached translation and grammar, see alfworld.py), groups are spread round-robin.
`submit` sends each worker its share of a batch at once and returns at once; `collect` reads
the answers back in the caller's order. Between the two the caller is free: the rollout
generates the next step of one wave of groups while the workers step (or reset) the other.
Each worker answers its requests in the order sent. `reset_all` / `step_all` are submit +
collect. A worker that crashes or does not answer within the timeout is replaced; its envs
come back as `EnvFailure` (their trajectories end with env_error) and the run goes on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field

from agentrl.cluster import available_cores  # noqa: F401 (where env_workers reads it)
from agentrl.env.alfworld import GameLoadError, StepResult, warm_up
from agentrl.env.data import Game
from agentrl.env.decoy import play_decoys
from agentrl.env.replay import replay_game


@dataclass
class EnvFailure:
    """An env that could not be reset or stepped (a bad game, or its worker died or hung).
    `worker_lost`: the worker, not the game, failed (a hang, a crash): the game may be played again."""

    message: str
    worker_lost: bool = False


@dataclass
class Pending:
    """One batch sent to the envs; `collect` fills `out` in the batch's order."""

    op: str
    out: list
    shares: dict[int, list[int]] = field(default_factory=dict)  # worker -> positions in the batch
    waiting: set[int] = field(default_factory=set)  # workers whose answer is not read yet
    refs: dict = field(default_factory=dict)  # Ray actors: worker -> (its generation, the answer's ObjectRef)


def _worker(conn, kind: str) -> None:
    from agentrl.env import env_factory  # a cycle at load: agentrl.env imports this module

    make_env = env_factory(kind)
    if kind == "alfworld":  # import the engine now (while the parent loads its model), not at the first reset
        warm_up()
    envs: dict[int, object] = {}
    try:
        while True:
            op, batch = conn.recv()
            if op == "shutdown":
                for env in envs.values():
                    env.close()
                conn.send([])
                return
            conn.send(apply_batch(envs, make_env, op, batch))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return  # the parent is gone (killed, or Ctrl-C reached the whole group): exit quietly, not with a traceback


def apply_batch(envs: dict, make_env, op: str, batch: list) -> list:
    """One request of a worker (a process here, a Ray actor in ray_pool.py) on the envs it holds."""
    out = []
    for handle, arg in batch:
        try:
            if op == "reset":
                envs[handle] = make_env(arg)
                out.append(envs[handle].reset())
            elif op == "step":
                out.append(envs[handle].step(arg))
            elif op == "release":
                env = envs.pop(handle, None)
                if env is not None:
                    env.close()
                out.append(None)
            elif op == "replay":  # a whole walkthrough, its env opened and closed here (replay.py)
                out.append(replay_game(make_env, *arg))
            elif op == "expert":  # a game played by ALFWorld's hand-coded expert, its env opened and closed here
                out.append(play_expert(*arg))
            elif op == "decoy":  # a walkthrough with decoy visits chosen by playing it, then replayed (decoy.py)
                out.append(play_decoys(make_env, *arg))
            elif op == "planner":  # a trajectory's commands replayed, some states labelled by the planner (planner.py)
                out.append(label_states(*arg))
        except Exception as e:  # noqa: BLE001 - one env's failure is its trajectory's, not the pool's
            if (env := envs.pop(handle, None)) is not None:  # closed: its library copy goes back to the free list
                with contextlib.suppress(Exception):  # a second failure, while closing, is not the one to report
                    env.close()
            out.append(EnvFailure(str(e) if isinstance(e, GameLoadError) else f"{e.__class__.__name__}: {e}"))
    return out


def play_expert(game, max_steps: int, seed: int):
    from agentrl.env.expert import play_handcoded  # the engine's expert: imported where it plays

    return play_handcoded(game, max_steps, seed)


def label_states(game, commands, n: int, start: int = 0):
    from agentrl.env.planner import label_commands  # the engine's planner: imported where it plans

    return label_commands(game, commands, n, start)


ONE_OFF = ("replay", "expert", "decoy", "planner")  # ops whose env is opened and closed within the request


def share(pool, op: str, items: list[tuple[int, object]], n_workers: int, what: str) -> Pending:
    """A request's plan: which worker gets which items. The envs of one game go to one worker
    (`pool._by_game`, round-robin over games); `pool._owner` maps env handles to workers.
    A replay holds no env after its answer: its items are dealt round-robin, nothing is owned."""
    if op in ONE_OFF:
        pending = Pending(op, [EnvFailure(f"{op} lost with its {what}", worker_lost=True)] * len(items))
        for i in range(len(items)):
            pending.shares.setdefault(i % n_workers, []).append(i)
        return pending
    if op == "reset":
        for handle, game in items:
            if game.game_id not in pool._by_game:
                pool._by_game[game.game_id] = len(pool._by_game) % n_workers
            pool._owner[handle] = pool._by_game[game.game_id]
    pending = Pending(op, [EnvFailure(f"env lost with its {what}")] * len(items))
    for i, (handle, _) in enumerate(items):
        if handle in pool._owner:
            pending.shares.setdefault(pool._owner[handle], []).append(i)
    if op == "release":
        for handle, _ in items:
            pool._owner.pop(handle, None)
    return pending


class _Batches:
    """The blocking calls, the same for envs in this process and in a pool: submit, then collect."""

    pids: tuple[int, ...] | list[int] = ()  # worker processes on this machine (none: envs in this process, or on Ray)

    def reset_all(self, games: list[tuple[int, Game]]) -> list[StepResult | EnvFailure]:
        return self.collect(self.submit("reset", games))

    def step_all(self, commands: list[tuple[int, str | None]]) -> list[StepResult | EnvFailure]:
        return self.collect(self.submit("step", commands))

    def release(self, handles: list[int]) -> None:
        """Close these envs; not waited for (a pool's workers do it while the caller generates)."""
        self.submit("release", [(h, None) for h in handles])


class LocalEnvs(_Batches):
    """The same interface as EnvPool with the envs in this process (env.workers 0): work is done at submit."""

    workers = 0
    overlap = False

    def __init__(self, make_env):
        self.make_env = make_env
        self._envs: dict[int, object] = {}

    def submit(self, op: str, items: list[tuple[int, object]]) -> Pending:
        if op == "release":  # nobody collects a release
            return Pending(op, [self._do(op, handle, arg) for handle, arg in items])
        return Pending(op, list(items), waiting={0})  # done at collect, so progress can follow it

    def collect(self, pending: Pending) -> list:
        if pending.waiting:
            pending.out, pending.waiting = [self._do(pending.op, h, arg) for h, arg in pending.out], set()
        return pending.out

    def _do(self, op: str, handle: int, arg):
        try:
            if op == "reset":
                self._envs[handle] = self.make_env(arg)
                return self._envs[handle].reset()
            if op == "step":
                return self._envs[handle].step(arg)
            if op == "replay":
                return replay_game(self.make_env, *arg)
            if op == "expert":
                return play_expert(*arg)
            if op == "decoy":
                return play_decoys(self.make_env, *arg)
            if op == "planner":
                return label_states(*arg)
            env = self._envs.pop(handle, None)  # release
            if env is not None:
                env.close()
        except GameLoadError as e:
            self._envs.pop(handle, None)
            return EnvFailure(str(e))
        except Exception as e:  # noqa: BLE001 - the engine itself failed: this trajectory only
            if op == "reset":
                raise
            return EnvFailure(f"{e.__class__.__name__}: {e}")
        return None

    def shutdown(self) -> None:
        self.release(list(self._envs))


class EnvPool(_Batches):
    def __init__(self, workers: int, kind: str = "alfworld", timeout_s: float = 120.0, overlap: bool = True):
        if workers < 1:
            raise ValueError("an env pool needs at least one worker")
        self.kind, self.timeout_s = kind, timeout_s
        self.overlap = overlap  # the rollout may generate for one wave of groups while the workers step another
        self._ctx = mp.get_context("spawn")  # no fork: the main process may hold CUDA and torch threads
        self._workers = [self._start() for _ in range(workers)]
        self._queue: list[deque[Pending]] = [deque() for _ in range(workers)]  # requests each worker has not answered
        self._owner: dict[int, int] = {}  # env handle -> worker index
        self._by_game: dict[str, int] = {}
        self.replaced = 0  # workers replaced after a crash or a hang

    def _start(self):
        conn, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self.kind), daemon=True, name="agentrl-env")
        proc.start()
        child.close()
        return proc, conn

    def submit(self, op: str, items: list[tuple[int, object]]) -> Pending:
        """Send each worker its share of `items` (reset: (handle, game), step: (handle, command),
        release: (handle, None)) and return without waiting."""
        pending = share(self, op, items, len(self._workers), "worker")
        for w, idx in pending.shares.items():
            try:
                self._workers[w][1].send((op, [items[i] for i in idx]))
            except (BrokenPipeError, OSError):
                pass  # noticed in collect, when it does not answer
            self._queue[w].append(pending)
            pending.waiting.add(w)
        return pending

    def collect(self, pending: Pending) -> list:
        """Wait for every answer to `pending` (answers to earlier requests are read on the way)."""
        deadline = time.monotonic() + self.timeout_s
        for w in sorted(pending.waiting):
            while w in pending.waiting:
                self._read(w, deadline)
        return pending.out

    def _read(self, w: int, deadline: float) -> None:
        """Read worker w's next answer into the oldest request it has not answered."""
        proc, conn = self._workers[w]
        answer, hung = None, False
        while answer is None:
            if conn.poll(0.05):
                try:
                    answer = conn.recv()
                except (EOFError, OSError):
                    break
            elif not proc.is_alive():
                break
            elif time.monotonic() > deadline:
                hung = True
                break
        if answer is None:  # crashed or hung: replace it; every request it had not answered fails
            proc.join(timeout=1 if not hung else 0)
            why = f"did not answer within {self.timeout_s:g}s" if hung else f"died (exit code {proc.exitcode})"
            for pending in self._queue[w]:
                for i in pending.shares[w]:
                    pending.out[i] = EnvFailure(f"env worker {why} during {pending.op}", worker_lost=True)
                pending.waiting.discard(w)
            self._replace(w)
            return
        pending = self._queue[w].popleft()
        for i, result in zip(pending.shares[w], answer):
            pending.out[i] = result
        pending.waiting.discard(w)

    def _replace(self, w: int) -> None:
        proc, conn = self._workers[w]
        proc.kill()
        proc.join()
        conn.close()
        self._workers[w] = self._start()
        self._queue[w].clear()
        self.replaced += 1
        for handle in [h for h, owner in self._owner.items() if owner == w]:
            del self._owner[handle]

    def ready(self) -> float:
        """Wait until every worker answers (its imports are done); the seconds waited."""
        t0 = time.perf_counter()
        pings = []
        for w, (_, conn) in enumerate(self._workers):
            ping = Pending("ping", [], shares={w: []}, waiting={w})
            try:
                conn.send(("ping", []))
            except (BrokenPipeError, OSError):
                pass
            self._queue[w].append(ping)
            pings.append(ping)
        for ping in pings:
            self.collect(ping)
        return time.perf_counter() - t0

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self._workers]

    def shutdown(self) -> None:
        for w, (proc, conn) in enumerate(self._workers):
            try:
                while self._queue[w] and conn.poll(5):  # answers still owed (releases) come first
                    conn.recv()
                    self._queue[w].popleft()
                conn.send(("shutdown", []))
                if conn.poll(10):
                    conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._workers = []

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
