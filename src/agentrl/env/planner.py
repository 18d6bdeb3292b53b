"""The PDDL planner as a labeler of the states a policy reached (`agentrl sft --relabel`: DAgger).

A warm start imitates walkthroughs: it only ever sees states on the expert's path, so one wrong
step puts it where it was never taught, and it wanders or loops. DAgger (Ross et al., 2011; the
way ALFWorld's own BUTLER agent was trained) asks the expert what to do in the states the policy
itself reached and trains on those answers too. The expert here is the one that wrote the game
files' walkthroughs: TextWorld's PDDL planner (fast-downward), which replans from any state of
the game (`PddlState.replan`, what the engine's `policy_commands` info returns).

`label_commands` replays a trajectory's commands in a fresh env of its game and asks the planner
at a few of the states it passed: the first where the policy left the planner's plan (the state
where imitation failed), then `n - 1` more spread evenly over the rest of the trajectory (where
a policy that left the path spends its steps). A state whose command the planner shares teaches
nothing new and is not labelled. Until the first departure one plan serves (the engine is
deterministic: a plan's steps, taken, leave the rest of it valid), so a trajectory costs at most
n + 1 planner calls. A planner call takes 0.6 s at the median, a few seconds at p90 and over a
minute on a few heat / clean / pick-two states (measured on 31 train games): the calls run on
the env pool's workers, one trajectory a request, and a worker that does not answer within
`env.worker_timeout_s` is replaced (that trajectory is skipped, counted).

What comes back is a replay record (replay.py's `Replay`) of the trajectory's commands with the
planner's command on each labelled step (`"planner"`), kept on disk keyed by the game file, the
commands, n and the engine: the labels are a pure function of those.
"""

from __future__ import annotations

import dataclasses
import re

from agentrl.env.alfworld import AlfworldEnv
from agentrl.env.data import Game
from agentrl.env.replay import Replay, ReplayCache, engine_versions, file_key, played, recorded_step

PLANNER_VERSION = 1  # bump when how states are chosen or labelled changes (a new key for every trajectory)
PLANNER_DIRNAME = "planner"  # under the cache root, beside replay/ and expert/
LABEL = "planner"  # a labelled step's key in the record: the planner's command at the state before it


def spread(first: int, length: int, n: int) -> list[int]:
    """The states labelled after the first departure `first` of a trajectory of `length` steps:
    `n - 1` step indices spread evenly over first+1 .. length-1 (fewer where fewer remain)."""
    rest = list(range(first + 1, length))
    k = min(max(n - 1, 0), len(rest))
    if k == 0:
        return []
    # evenly spaced, the last step included: a loop's states come late
    return sorted({rest[round((i + 1) * len(rest) / k) - 1] for i in range(k)})


def planner_of(env: AlfworldEnv):
    """The TextWorld PDDL env under the env's wrappers (it holds the game state and the planner)."""
    inner = env._env
    while not hasattr(inner, "_pddl_state"):
        inner = getattr(inner, "_wrapped_env", None)
        if inner is None:
            raise RuntimeError("the engine has no PDDL state to plan from (not an ALFWorld PDDL game)")
    return inner


def plan_from(env: AlfworldEnv) -> list[str]:
    """The planner's commands from the env's current state to the goal ([] where it finds none)."""
    inner = planner_of(env)
    return list(inner._pddl_state.replan(inner._entity_infos) or [])


def label_commands(game: Game, commands: list[str | None], n: int, start: int = 0) -> Replay:
    """Replay `commands` (None: an invalid reply, the engine's no-op) in a fresh env of `game` and
    label up to `n` states from step `start` on with the planner's next command (see the module's
    docstring). The record's steps are what the engine answered, as a walkthrough's replay records
    them; a labelled step also carries `"planner"`: the command the planner would have sent there."""
    env = AlfworldEnv(game)
    try:
        first = env.reset()
        record = Replay(game.game_id, {"observation": first.observation, "admissible": list(first.admissible)})
        admissible, departed, chosen, labels = first.admissible, None, set(), 0
        plan = plan_from(env) if start == 0 else []
        for t, command in enumerate(commands):
            if (departed is not None and t in chosen) or (t == start and t > 0):
                plan = plan_from(env)
            label = None
            if t >= start and plan and (departed is None or t in chosen) and command != plan[0] and labels < n:
                label = plan[0] if plan[0] in admissible else None  # (never seen inadmissible: not taught if it is)
                if departed is None:
                    departed, chosen = t, set(spread(t, len(commands), n))
            r = env.step(command)
            step = recorded_step(command, r)
            if label is not None:
                step[LABEL], labels = label, labels + 1
            record.steps.append(step)
            if departed is None and plan and t >= start:
                plan = plan[1:]  # the plan's own step: the rest of it still holds
            admissible = r.admissible
            if r.done:
                break
        record.won = bool(record.steps and record.steps[-1]["won"])
        return record
    finally:
        env.close()


def labels_key(game: Game, commands: list[str | None], n: int, start: int = 0) -> str | None:
    """The cache key of a trajectory's labels: its game file, its commands, n, the first step
    labelled (named where it is not 0), the engine."""
    return file_key(game, PLANNER_VERSION, [LABEL, engine_versions(), list(commands), int(n), *([int(start)] if start else [])])


def planner_labels(trajectories: list[tuple], backend, cache: ReplayCache | None, n: int, on_done=None) -> dict[str, Replay]:
    """Each trajectory's labelled record by its id: from `cache` (`<cache>/planner/`), else labelled on
    `backend`'s workers (pool op "planner", one trajectory a request) and cached. `trajectories`:
    (id, game, commands[, the first step that may be labelled]); `on_done(k)`: k more are done."""
    games, args = [], {}
    for tid, game, cmds, *start in trajectories:
        games.append(dataclasses.replace(game, game_id=tid))  # `played` keys its records by game id
        args[tid] = (list(cmds), n, int(start[0]) if start else 0)
    records, _ = played(games, backend, cache, "planner", lambda g: labels_key(g, *args[g.game_id]),
                        lambda g: (g, *args[g.game_id]), on_done)
    return records


def object_seen_at(game: Game, initial_observation: str, observations: list[str]) -> int | None:
    """The first step whose state has seen the task's object (the initial observation, or what an
    earlier step answered, names an instance of it: "apple 1"); None: the trajectory never saw it."""
    from agentrl.env.expert import task_params

    name = task_params(game)["object_target"]
    seen = re.compile(rf"\b{re.escape(name)} \d+\b", re.IGNORECASE)
    for t, text in enumerate([initial_observation, *observations]):
        if seen.search(text or ""):
            return t
    return None


__all__ = ["LABEL", "PLANNER_DIRNAME", "label_commands", "plan_from", "planner_labels", "spread"]
