"""ALFWorld's hand-coded expert as the warm start's teacher (`sft.expert: handcoded`).

A game file's walkthrough is the PDDL planner's plan, written knowing where every object is: it
goes straight to the one drawer that holds the key. A policy that imitates it learns where things
were in the training rooms, which it cannot know in a room it has not seen. ALFWorld's hand-coded
expert (`alfworld.agents.expert.HandCodedTWAgent`, the teacher of ALFWorld's own BUTLER agent)
acts on what it has observed: it looks around, opens and checks receptacles in turn until it sees
the object, then carries out the task, so its demonstrations show a search an agent can repeat
anywhere.

The expert is played here through the real engine (the env's facts on: it reads them to know what
it holds), one game per env-pool request (op "expert"), and what it did is kept as a replay record
(replay.py) of the game whose walkthrough is the expert's commands: sft then runs unchanged on
those games, the record answering their replay. The expert's choices depend only on the game file
and the seed (where it is stuck it draws a random admissible command), so a record is kept on
disk keyed by both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from agentrl.env.alfworld import AlfworldEnv
from agentrl.env.data import Game, task_dir
from agentrl.env.replay import Replay, ReplayCache, engine_versions, file_key, played, recorded_step, replay_key

EXPERT_VERSION = 1  # bump when how the expert is played changes (a new key for every game)
EXPERT_DIRNAME = "expert"  # under the cache root, beside replay/ and sft-data/


def task_params(game: Game) -> dict:
    """The expert's task parameters, read from the game's task directory name."""
    m = task_dir(game)
    if m is None:
        raise ValueError(f"cannot read the task of {game.game_id} from its directory name")
    from alfworld.gen import constants

    def norm(v: str) -> str:
        return "" if v == "None" else v.lower() if v in constants.OBJECTS else v

    light = game.task_type == "look_at_obj_in_light"
    return {"task_type": game.task_type, "object_target": norm(m["object"]), "mrecep_target": norm(m["mrecep"]),
            "parent_target": "" if light else norm(m["parent"]), "toggle_target": norm(m["parent"]) if light else "",
            "object_sliced": False}


def play_handcoded(game: Game, max_steps: int, seed: int) -> Replay:
    """Play `game` with ALFWorld's hand-coded expert for at most `max_steps` commands, as its own
    AlfredExpert wrapper does (the first command "look"; then the expert's next command after
    each step; "look" where it names a command that is not admissible). The record's steps are the
    commands sent and what the engine answered, as a walkthrough's replay records them."""
    from alfworld.agents.expert import HandCodedAgentFailed, HandCodedAgentTimeout, HandCodedTWAgent

    params = task_params(game)
    expert = HandCodedTWAgent(max_steps=max_steps + 1)
    expert.task_params = params
    expert.policy = expert.get_task_policy(params)(params, max_steps=max_steps + 1)
    state = random.getstate()
    random.seed(seed)  # the expert draws from the module's random where it is stuck
    env = AlfworldEnv(game, facts=True)
    try:
        first = env.reset()
        record = Replay(game.game_id, {"observation": first.observation, "admissible": list(first.admissible)})
        expert.observe(env.state["feedback"])
        command = "look"
        for _ in range(max_steps):
            r = env.step(command)
            record.steps.append(recorded_step(command, r))
            if r.done:
                break
            try:
                nxt = expert.act(env.state, 0, r.won, command)
            except (HandCodedAgentFailed, HandCodedAgentTimeout):
                break  # the expert gives up: a record that does not win (sft skips the game, counted)
            command = nxt if nxt in r.admissible else "look"
        record.won = bool(record.steps and record.steps[-1]["won"])
        return record
    finally:
        random.setstate(state)
        env.close()


def expert_key(game: Game, max_steps: int, seed: int) -> str | None:
    """The cache key of a game's expert record: its file's bytes, the expert, T_max, the seed, the engine."""
    return file_key(game, EXPERT_VERSION, ["handcoded", engine_versions(), max_steps, seed])


def game_seed(game: Game, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed} {game.game_id}".encode()).digest()[:4], "little")


def expert_games(games: list[Game], backend, cache: ReplayCache | None, replays: ReplayCache | None,
                 max_steps: int, seed: int, fuzzy_threshold: float, on_game=None) -> tuple[list[Game], list[tuple[str, str]]]:
    """The games with their walkthrough replaced by the hand-coded expert's commands, and the games
    skipped (the expert did not win within `max_steps`, or the engine failed), with why. Each
    record comes from `cache` (`<cache>/expert/`) or is played on `backend`'s workers (op
    "expert") and cached; it is also put in `replays` under the new walkthrough's replay key, so
    sft's replay reads it (it is what replaying those commands gives: the engine is deterministic,
    tested)."""
    records, _ = played(games, backend, cache, "expert", lambda g: expert_key(g, max_steps, seed),
                        lambda g: (g, max_steps, game_seed(g, seed)), on_game)
    out, skipped = [], []
    for g in games:
        r = records[g.game_id]
        if r.error is not None or not r.won:
            skipped.append((g.game_id, r.error or f"the hand-coded expert did not win within {max_steps} steps"))
            continue
        taught = dataclasses.replace(g, walkthrough=[s["command"] for s in r.steps])
        key = replay_key(taught, fuzzy_threshold) if replays is not None else None
        if key is not None and replays.get(key) is None:
            replays.put(key, r)
        out.append(taught)
    return out, skipped


__all__ = ["expert_games", "play_handcoded", "task_params"]
