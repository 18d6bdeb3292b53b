"""Decoy visits: the walkthrough with the one step of search it never shows (`sft.decoys N`).

A game file's walkthrough goes straight to the receptacle that holds the task's object and takes
it there. A policy cloned on walkthroughs learns "go somewhere, then take what is there": on the
held-out games, the warm start on every train game took the wrong object right after its first
`go to` in 113 of its 142 lost episodes (docs/measurements/decoys.md). A decoy visit shows what
no walkthrough does: before the walkthrough goes to the object's receptacle, it first goes to N
other receptacles that, on arrival, show other things and no such object, then goes on as
walked. The decoy's own `go to` is an arbitrary choice, so it is not taught (Game.untaught: sft
masks its reply); what is taught is the reply after it, at a place without the object: move on.
Measured at N = 1 it made the policy worse: every taught walkthrough found the object at its second
place, and the policy learnt that position, not to read the observation (docs/measurements/decoys.md).

The decoys are chosen by playing the game (pool op "decoy", one game per request): the
walkthrough up to the object's receptacle, then the other admissible `go to`s, in an order
drawn from the seed, visited in turn until N qualify. The new walkthrough is then replayed from
the reset (replay.py's `replay_game`), and that replay is the record: what sft's replay reads,
exactly what the engine answers those commands. Records are cached by game file, walkthrough,
N and seed (`<cache>/decoy/`).
"""

from __future__ import annotations

import dataclasses
import random
import re

from agentrl.env.data import Game, task_object
from agentrl.env.expert import game_seed
from agentrl.env.replay import (Replay, ReplayCache, engine_versions, file_key, played, replay_game, replay_key,
                                sent_command)

DECOY_VERSION = 1  # bump when how decoys are chosen changes (a new key for every game)
DECOY_DIRNAME = "decoy"  # under the cache root, beside replay/, expert/ and sft-data/


def object_visit(walkthrough, obj: str) -> int | None:
    """Index of the `go to X` after which the walkthrough first takes the task's object from X
    (an `open X` may come between); None when there is none (the object is taken where the game
    starts, or the walkthrough never takes it)."""
    take = re.compile(rf"take {re.escape(obj)} \d+ from (.+)")
    for i, command in enumerate(walkthrough):
        if (m := take.fullmatch(command)) is not None:
            where = f"go to {m[1]}"
            return next((j for j in range(i - 1, -1, -1) if walkthrough[j] == where), None)
    return None


def names_object(observation: str, obj: str) -> bool:
    """The observation names an instance of the object (`a apple 1`; `pen` is not `pencil 1`)."""
    return re.search(rf"\b{re.escape(obj)} \d+\b", observation.lower()) is not None


def is_decoy(observation: str, obj: str) -> bool:
    """What arriving there shows is a place with other things in view and not the object: the
    place where a cloned policy takes what it sees (an empty or a closed receptacle offers nothing
    to take wrongly)."""
    return re.search(r"you see an? ", observation) is not None and not names_object(observation, obj)


def play_decoys(make_env, game: Game, n: int, seed: int, fuzzy_threshold: float) -> Replay:
    """`game`'s walkthrough with up to `n` decoy visits before its object's receptacle, replayed
    from the reset (a pool worker's body for op "decoy"). A game without such a visit (see
    `object_visit`), or with fewer qualifying receptacles, gets as many as there are: zero gives
    the walkthrough's own replay."""
    walkthrough = list(game.walkthrough)
    obj = task_object(game)
    if obj is None:
        raise ValueError(f"cannot read the task's object of {game.game_id} from its task directory")
    j = object_visit(walkthrough, obj)
    chosen: list[str] = []
    if j is not None and n > 0:
        env = make_env(game)
        try:
            admissible = env.reset().admissible
            for cmd in walkthrough[:j]:
                admissible = env.step(sent_command(cmd, admissible, fuzzy_threshold)).admissible
            candidates = sorted(c for c in admissible if c.startswith("go to ") and c != walkthrough[j])
            random.Random(seed).shuffle(candidates)
            for c in candidates:  # a `go to` changes only where the agent is: each is looked at from the last
                r = env.step(c)
                if r.done:
                    break
                # (a shelf may share the object's shelf's place: from there the walkthrough's `go to` is no command)
                if is_decoy(r.observation, obj) and walkthrough[j] in r.admissible:
                    chosen.append(c)
                    if len(chosen) == n:
                        break
        finally:
            env.close()
    taught = dataclasses.replace(game, walkthrough=tuple(walkthrough[:j] + chosen + walkthrough[j:]) if chosen
                                 else tuple(walkthrough))
    return replay_game(make_env, taught, fuzzy_threshold)


def decoy_key(game: Game, n: int, seed: int, fuzzy_threshold: float) -> str | None:
    """The cache key of a game's decoy record: its file, its walkthrough, N, the seed, the engine."""
    return file_key(game, DECOY_VERSION, ["decoy", engine_versions(), n, seed, float(fuzzy_threshold),
                                          list(game.walkthrough)])


@dataclasses.dataclass
class DecoyStats:
    games: int = 0
    decoyed: int = 0  # games given at least one decoy visit
    visits: int = 0  # decoy visits in all
    plain: int = 0  # games taught as walked: no object visit to put a decoy before, or no receptacle qualified

    def summary(self) -> dict:
        return dataclasses.asdict(self)


def decoy_games(games: list[Game], backend, cache: ReplayCache | None, replays: ReplayCache | None, n: int, seed: int,
                fuzzy_threshold: float, on_game=None) -> tuple[list[Game], list[tuple[str, str]], DecoyStats]:
    """The games with decoy visits in their walkthrough (their indices in `Game.untaught`), the
    games skipped (the engine failed, or the new walkthrough did not win: counted, never taught),
    and the counts. Each record comes from `cache` or is played on `backend`'s workers (op
    "decoy") and cached; it is also put in `replays` under the new walkthrough's replay key, so
    sft's replay reads it."""
    records, _ = played(games, backend, cache, "decoy", lambda g: decoy_key(g, n, seed, fuzzy_threshold),
                        lambda g: (g, n, game_seed(g, seed), fuzzy_threshold), on_game)
    out, skipped, stats = [], [], DecoyStats(games=len(games))
    for g in games:
        r = records[g.game_id]
        if r.error is not None or not r.won:
            skipped.append((g.game_id, r.error or "the walkthrough with decoy visits did not win"))
            continue
        commands = [s["command"] for s in r.steps]
        j = object_visit(list(g.walkthrough), task_object(g) or "")
        # the inserted visits: the steps before the walkthrough's own `go to` (never a decoy) comes
        k = 0 if j is None or g.walkthrough[j] not in commands[j:] else commands.index(g.walkthrough[j], j) - j
        if k <= 0:
            out.append(g)
            stats.plain += 1
            continue
        taught = dataclasses.replace(g, walkthrough=tuple(g.walkthrough[:j]) + tuple(commands[j:j + k])
                                     + tuple(g.walkthrough[j:]), untaught=tuple(range(j, j + k)))
        key = replay_key(taught, fuzzy_threshold) if replays is not None else None
        if key is not None and replays.get(key) is None:
            replays.put(key, r)
        out.append(taught)
        stats.decoyed += 1
        stats.visits += k
    return out, skipped, stats


__all__ = ["DecoyStats", "decoy_games", "is_decoy", "names_object", "object_visit", "play_decoys"]
