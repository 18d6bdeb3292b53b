"""Walkthrough replay: each game's expert walkthrough run through the real engine, once.

The warm start (train/sft.py) learns from the walkthroughs replayed through the env. The replay
is a pure function of the game file, its walkthrough, the action mapping's threshold and the
engine, so it runs once per game: on the env pool's workers (one game per request, op
"replay"), and its record is kept on disk keyed by a hash of those inputs. What is kept are the
env's facts only (each command sent, the observation, the admissible commands, won/done), never
tokens: a record stays valid under any prompt, tokenizer or model, and sft rebuilds its examples
from it by the rollout's own path (`RecordedEnv` stands in for the engine).

A record whose walkthrough does not win is kept (`won` false: sft skips the game, counted); a game
the engine cannot load, or whose worker failed, is never kept (it may pass next time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import lzma
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import NOTHING_HAPPENS, GameLoadError, StepResult
from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.io import atomic_path, atomic_write_text
from agentrl.prompt import reply_text

log = logging.getLogger(__name__)

REPLAY_DIRNAME = "replay"  # under the cache root ($AGENTRL_CACHE, else ~/.cache/agentrl), beside sft-data/
REPLAY_VERSION = 1  # bump when what a record holds, or how it is replayed, changes (a new key for every game)
KEY = re.compile(r"v\d+-[0-9a-f]{32}")  # what replay_key makes (an imported key names a file: nothing else)
IN_FLIGHT = 4  # replay requests per worker not yet answered: the workers never wait, the pipes stay small


@dataclass
class Replay:
    """One game's walkthrough as the engine answered it: the reset, then each step (the command
    sent, what came back). `error`: it could not be replayed (never cached)."""

    game_id: str
    reset: dict = field(default_factory=dict)  # observation, admissible
    steps: list[dict] = field(default_factory=list)  # command, observation, admissible, won, done
    won: bool = False
    error: str | None = None


@dataclass
class ReplayStats:
    games: int = 0
    hits: int = 0  # read from the cache
    replayed: int = 0  # run through the engine now
    won: int = 0
    unwinnable: int = 0  # the walkthrough ends without a win
    failed: int = 0  # the engine or its worker failed (not cached)
    corrupt: int = 0  # cache files that did not read back (replayed and rewritten)
    retried: int = 0  # lost with a worker that hung or died, and played once more
    seconds: float = 0.0


def replay_game(make_env, game: Game, fuzzy_threshold: float) -> Replay:
    """Replay `game`'s walkthrough in this process (a pool worker's body for op "replay"). Each
    command is sent as a rollout would send the taught reply `Action: <cmd>`: parsed, then mapped
    to an admissible command (the same `map_action` and threshold), so the record answers exactly
    the commands the warm start's rollout sends. Stops at won or done."""
    env = make_env(game)
    try:
        first = env.reset()
        record = Replay(game.game_id, {"observation": first.observation, "admissible": list(first.admissible)})
        admissible = first.admissible
        for cmd in game.walkthrough:
            command = sent_command(cmd, admissible, fuzzy_threshold)
            r = env.step(command)
            record.steps.append(recorded_step(command, r))
            admissible = r.admissible
            if r.done:
                break
        record.won = bool(record.steps and record.steps[-1]["won"])
        return record
    finally:
        env.close()


def sent_command(cmd: str, admissible, fuzzy_threshold: float) -> str | None:
    """What a rollout sends for the taught reply `Action: <cmd>`: parsed, then mapped to an
    admissible command (None: invalid, the engine's no-op)."""
    return map_action(parse_action(reply_text(cmd, "action")), admissible, fuzzy_threshold)[0]


def recorded_step(command: str | None, r: StepResult) -> dict:
    """A record's step: the command sent and what the engine answered."""
    return {"command": command, "observation": r.observation, "admissible": list(r.admissible), "won": r.won, "done": r.done}


class RecordedEnv:
    """The env interface answered from a record: the commands the record holds, in its order, get
    its results; an invalid command (None, or not admissible now) is the engine's no-op, as in
    AlfworldEnv; any other command was never recorded and fails the trajectory (never guessed)."""

    def __init__(self, game: Game, record: Replay):
        if record.error is not None:
            raise GameLoadError(record.error)
        self.game, self.record = game, record
        self._next, self._admissible, self.won = 0, list(record.reset["admissible"]), False

    def reset(self) -> StepResult:
        self._next, self._admissible, self.won = 0, list(self.record.reset["admissible"]), False
        return StepResult(self.record.reset["observation"], list(self._admissible), False, False)

    def step(self, command: str | None) -> StepResult:
        steps = self.record.steps
        if self._next < len(steps) and steps[self._next]["command"] == command:
            s = steps[self._next]
            self._next += 1
            self._admissible, self.won = list(s["admissible"]), bool(s["won"])
            return StepResult(s["observation"], list(s["admissible"]), bool(s["won"]), bool(s["done"]))
        if command is None or command not in self._admissible:
            return StepResult(NOTHING_HAPPENS, list(self._admissible), self.won, self.won)
        raise RuntimeError(f"the replay of {self.game.game_id} has no record of {command!r} at step {self._next + 1}")

    def close(self) -> None:
        """Nothing held."""


def recorded_envs(records: dict[str, Replay]) -> Callable[[Game], RecordedEnv]:
    """A make_env over `records` (by game id)."""
    return lambda game: RecordedEnv(game, records[game.game_id])


# ---------------------------------------------------------------- the cache
@functools.lru_cache(maxsize=1)
def engine_versions() -> tuple[str, ...]:
    """The engine's packages (their text may change with a release)."""
    out = []
    for dist in ("textworld", "alfworld"):
        try:
            out.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} absent")
    return tuple(out)


def file_key(game: Game, version: int, parts: list) -> str | None:
    """A cache key of what playing `game` gives: its file's bytes and `parts` (what else decides
    the play), under `version`. None: the game has no file (synthetic games, not worth caching)."""
    try:
        data = Path(game.path).read_bytes()
    except (OSError, TypeError):
        return None
    h = hashlib.sha256(json.dumps([version, *parts]).encode())
    h.update(data)
    return f"v{version}-{h.hexdigest()[:32]}"


def replay_key(game: Game, fuzzy_threshold: float) -> str | None:
    """The cache key of a game's replay: its file's bytes, its walkthrough, the threshold, the
    engine and REPLAY_VERSION."""
    return file_key(game, REPLAY_VERSION, [engine_versions(), float(fuzzy_threshold), list(game.walkthrough)])


def check_record(obj, key: str) -> Replay:
    """A cache file's JSON as a Replay; ValueError when it is not one (damaged, or another version)."""
    if not isinstance(obj, dict) or obj.get("key") != key or not KEY.fullmatch(str(key)):
        raise ValueError("not a replay record of this key")
    r = obj.get("record")
    steps = r.get("steps") if isinstance(r, dict) else None
    if not isinstance(steps, list) or not isinstance(r.get("reset"), dict) or not isinstance(r.get("won"), bool):
        raise ValueError("incomplete replay record")
    for s in [r["reset"], *steps]:
        if not isinstance(s, dict) or not isinstance(s.get("observation"), str) or not isinstance(s.get("admissible"), list):
            raise ValueError("incomplete replay step")
    if any(not {"command", "won", "done"} <= set(s) for s in steps):
        raise ValueError("incomplete replay step")
    return Replay(str(r.get("game_id", "")), r["reset"], steps, r["won"])


class ReplayCache:
    """Replay records under `root` (`<cache>/replay/`), one JSON file per key, written atomically."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> Replay | None | bool:
        """The record, None when absent, False when the file is damaged (it will be rewritten)."""
        try:
            text = self.path(key).read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            return False
        try:
            return check_record(json.loads(text), key)
        except ValueError:  # json.JSONDecodeError is a ValueError
            return False

    def put(self, key: str, record: Replay) -> None:
        if record.error is None:
            atomic_write_text(self.path(key), json.dumps({"key": key, "record": asdict(record)}) + "\n")


# ---------------------------------------------------------------- the fan-out
def replay_walkthroughs(games: list[Game], backend, cache: ReplayCache | None, fuzzy_threshold: float,
                        on_game: Callable[[int], None] | None = None) -> tuple[dict[str, Replay], ReplayStats]:
    """Every game's replay record by game id: from the cache, else replayed on `backend`'s workers
    (an EnvPool, a RayEnvPool, or LocalEnvs: in this process) and cached. `on_game(n)`: n more
    games are done."""
    return played(games, backend, cache, "replay", lambda g: replay_key(g, fuzzy_threshold),
                  lambda g: (g, fuzzy_threshold), on_game)


def played(games: list[Game], backend, cache: ReplayCache | None, op: str, key_of, arg_of,
           on_game: Callable[[int], None] | None = None) -> tuple[dict[str, Replay], ReplayStats]:
    """Every game's record by game id: from the cache (under `key_of(game)`), else played on
    `backend`'s workers by `op` (pool op "replay", or "expert": env/expert.py) with `arg_of(game)`
    and cached. A window of requests, one game each, stays in flight on every worker."""
    t0 = time.perf_counter()
    stats, records, todo = ReplayStats(games=len(games)), {}, []
    for g in games:
        key = key_of(g) if cache is not None else None
        found = cache.get(key) if key is not None else None
        if isinstance(found, Replay):
            found.game_id = g.game_id
            records[g.game_id] = found
            stats.hits += 1
        else:
            stats.corrupt += found is False
            todo.append((g, key))
    if on_game is not None and stats.hits:
        on_game(stats.hits)
    lost: list = []
    _fan_out(backend, op, arg_of, todo, records, cache, stats, on_game, lost)
    if lost:  # a worker hung or died under them: a transient loss, not the game's; once more on fresh workers,
        # one request a worker at a time, so a game that hangs again takes no other with it
        log.warning("%d %s lost with an env worker that hung or died during %s: played once more", len(lost),
                    "trajectories" if op == "planner" else "games", op)
        stats.retried = len(lost)
        _fan_out(backend, op, arg_of, lost, records, cache, stats, on_game, None, in_flight=1)
    for r in records.values():
        stats.won += r.won and r.error is None
        stats.unwinnable += not r.won and r.error is None
        stats.failed += r.error is not None
    stats.seconds = time.perf_counter() - t0
    return {g.game_id: records[g.game_id] for g in games}, stats


def _fan_out(backend, op: str, arg_of, todo: list, records: dict, cache: ReplayCache | None, stats: ReplayStats,
             on_game, lost: list | None, in_flight: int = IN_FLIGHT) -> None:
    """Play `todo` ((game, cache key) pairs) on the backend's workers, `in_flight` requests in
    flight; with a `lost` list, the pairs lost with a worker go there instead of into `records`."""
    per_request = max(1, getattr(backend, "workers", 1)) if todo else 1  # (asks a lazy pool to start)
    window: list = []
    for start in range(0, len(todo), per_request):
        chunk = todo[start:start + per_request]
        window.append((backend.submit(op, [(i, arg_of(g)) for i, (g, _) in enumerate(chunk)]), chunk))
        if len(window) >= in_flight:
            _collect(backend, window.pop(0), records, cache, stats, on_game, lost)
    while window:
        _collect(backend, window.pop(0), records, cache, stats, on_game, lost)


def _collect(backend, request, records: dict, cache: ReplayCache | None, stats: ReplayStats, on_game,
             lost: list | None) -> None:
    pending, chunk = request
    done = 0
    for (g, key), result in zip(chunk, backend.collect(pending)):
        if lost is not None and getattr(result, "worker_lost", False):
            lost.append((g, key))
            continue
        record = result if isinstance(result, Replay) else Replay(g.game_id, error=getattr(result, "message", str(result)))
        records[g.game_id] = record
        stats.replayed += 1
        done += 1
        if cache is not None and key is not None:
            cache.put(key, record)
    if on_game is not None and done:
        on_game(done)


# ---------------------------------------------------------------- carrying the cache
def export_replays(cache: ReplayCache, games: list[Game], fuzzy_threshold: float, out: Path) -> int:
    """The cached records of `games` as one xz-compressed JSONL (one cache file a line), written
    atomically; returns how many. Games not in the cache are left out."""
    n = 0
    with atomic_path(out, directory=False) as tmp, lzma.open(tmp, "wt", preset=6) as f:
        for g in games:
            key = replay_key(g, fuzzy_threshold)
            if key is not None and isinstance(cache.get(key), Replay):
                f.write(cache.path(key).read_text())
                n += 1
    return n


def import_replays(cache: ReplayCache, src: Path) -> int:
    """Load an `export_replays` file into the cache; returns how many records. A line that is not
    a whole record is a UserError naming the line (nothing after it is imported)."""
    n = 0
    try:
        with lzma.open(src, "rt") as f:
            for i, line in enumerate(f, 1):
                try:
                    obj = json.loads(line)
                    record = check_record(obj, obj.get("key") if isinstance(obj, dict) else None)
                except ValueError as e:
                    raise UserError(f"{src}:{i}: not a replay record ({e})") from None
                cache.put(obj["key"], record)
                n += 1
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise UserError(f"cannot read {src}: {e}") from None
    return n
