"""Env work off the main process: ALFWorld envs live in worker processes.

An `EnvPool` keeps N spawned workers. Envs of one game go to the same worker (it then reuses
the game's cached translation and grammar, see alfworld.py), groups are spread round-robin.
`reset_all` / `step_all` send each worker its share of a batch at once and collect the
results in the caller's order, so N workers step N envs at a time. A worker that crashes or
does not answer within the timeout is replaced; its envs come back as `EnvFailure` (their
trajectories end with env_error) and the run goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

from agentrl.env.alfworld import GameLoadError, StepResult
from agentrl.env.data import Game


@dataclass
class EnvFailure:
    """An env that could not be reset or stepped (a bad game, or its worker died or hung)."""

    message: str


def _worker(conn, kind: str) -> None:
    from agentrl.env import env_factory

    make_env = env_factory(kind)
    envs: dict[int, object] = {}
    while True:
        op, batch = conn.recv()
        if op == "shutdown":
            for env in envs.values():
                env.close()
            conn.send([])
            return
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
            except Exception as e:  # noqa: BLE001 - one env's failure is its trajectory's, not the pool's
                envs.pop(handle, None)
                out.append(EnvFailure(str(e) if isinstance(e, GameLoadError) else f"{e.__class__.__name__}: {e}"))
        conn.send(out)


class LocalEnvs:
    """The same interface as EnvPool with the envs in this process (env.workers 0)."""

    def __init__(self, make_env):
        self.make_env = make_env
        self._envs: dict[int, object] = {}

    def reset_all(self, games: list[tuple[int, Game]]) -> list[StepResult | EnvFailure]:
        out = []
        for handle, game in games:
            try:
                self._envs[handle] = self.make_env(game)
                out.append(self._envs[handle].reset())
            except GameLoadError as e:
                self._envs.pop(handle, None)
                out.append(EnvFailure(str(e)))
        return out

    def step_all(self, commands: list[tuple[int, str | None]]) -> list[StepResult | EnvFailure]:
        out = []
        for handle, command in commands:
            try:
                out.append(self._envs[handle].step(command))
            except Exception as e:  # noqa: BLE001 - the engine itself failed: this trajectory only
                out.append(EnvFailure(f"{e.__class__.__name__}: {e}"))
        return out

    def release(self, handles: list[int]) -> None:
        for handle in handles:
            env = self._envs.pop(handle, None)
            if env is not None:
                env.close()

    def shutdown(self) -> None:
        self.release(list(self._envs))


class EnvPool:
    def __init__(self, workers: int, kind: str = "alfworld", timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError("an env pool needs at least one worker")
        self.kind, self.timeout_s = kind, timeout_s
        self._ctx = mp.get_context("spawn")  # no fork: the main process may hold CUDA and torch threads
        self._workers = [self._start() for _ in range(workers)]
        self._owner: dict[int, int] = {}  # env handle -> worker index
        self._by_game: dict[str, int] = {}
        self.replaced = 0  # workers replaced after a crash or a hang

    def _start(self):
        conn, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self.kind), daemon=True, name="agentrl-env")
        proc.start()
        child.close()
        return proc, conn

    def _worker_for(self, game: Game) -> int:
        if game.game_id not in self._by_game:
            self._by_game[game.game_id] = len(self._by_game) % len(self._workers)
        return self._by_game[game.game_id]

    def _run(self, op: str, items: list[tuple[int, object]]) -> list:
        """Send each worker its items, gather the answers in the items' order."""
        shares: dict[int, list[int]] = {}
        for i, (handle, _) in enumerate(items):
            shares.setdefault(self._owner[handle], []).append(i)
        for w, idx in shares.items():
            try:
                self._workers[w][1].send((op, [items[i] for i in idx]))
            except (BrokenPipeError, OSError):
                pass  # noticed below, when it does not answer
        out: list = [None] * len(items)
        deadline = time.monotonic() + self.timeout_s
        for w, idx in shares.items():
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
            if answer is None:  # crashed or hung: replace it; its envs are lost
                proc.join(timeout=1 if not hung else 0)
                why = f"did not answer within {self.timeout_s:g}s" if hung else f"died (exit code {proc.exitcode})"
                self._replace(w)
                answer = [EnvFailure(f"env worker {why} during {op}") for _ in idx]
            for i, result in zip(idx, answer):
                out[i] = result
        return out

    def _replace(self, w: int) -> None:
        proc, conn = self._workers[w]
        proc.kill()
        proc.join()
        conn.close()
        self._workers[w] = self._start()
        self.replaced += 1
        for handle in [h for h, owner in self._owner.items() if owner == w]:
            del self._owner[handle]

    def reset_all(self, games: list[tuple[int, Game]]) -> list[StepResult | EnvFailure]:
        for handle, game in games:
            self._owner[handle] = self._worker_for(game)
        return self._run("reset", games)

    def step_all(self, commands: list[tuple[int, str | None]]) -> list[StepResult | EnvFailure]:
        out: list = [EnvFailure("env lost with its worker")] * len(commands)
        idx = [i for i, (h, _) in enumerate(commands) if h in self._owner]
        for i, result in zip(idx, self._run("step", [commands[i] for i in idx])):
            out[i] = result
        return out

    def release(self, handles: list[int]) -> None:
        live = [(h, None) for h in handles if h in self._owner]
        self._run("release", live)
        for h, _ in live:
            self._owner.pop(h, None)

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self._workers]

    def shutdown(self) -> None:
        for proc, conn in self._workers:
            try:
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
