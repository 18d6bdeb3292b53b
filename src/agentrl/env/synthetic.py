"""A small synthetic text task: does the trainer learn at all?

Each game states a household goal ("put a mug in the fridge") and lists two admissible
commands, the object moved to the right or to a wrong receptacle; only the first wins. Choosing it wins, any other admissible
command ends the episode lost, an invalid reply is ALFWorld's no-op ("Nothing happens.").
It runs in microseconds, has no files, and a 135M model starts well below perfect, so a
short GRPO run must raise its success: the learning test, and `configs/synthetic.yaml`.

Games are generated from their index (deterministic); the held-out split uses different
indices than train, so evaluation never sees a training game.
"""

from __future__ import annotations

import random
from pathlib import Path

from agentrl.env.alfworld import NOTHING_HAPPENS, StepResult
from agentrl.env.data import Game

TASK_TYPE = "synthetic_choice"
OBJECTS = ("apple", "mug", "book", "knife", "egg", "bowl", "pen", "plate", "tomato", "vase", "cup", "lettuce")
RECEPTACLES = ("fridge", "shelf", "drawer", "sinkbasin", "cabinet", "desk", "countertop", "garbagecan")
SPLIT_OFFSET = {"train": 0, "valid_seen": 100_000, "valid_unseen": 200_000, "valid_train": 300_000}

SYSTEM = "Solve the household task. Reply with two lines:\nThought: <reasoning>\nAction: <one available command>"
EXAMPLE = (
    "Your task is to: put a pillow in the armchair.\nAvailable commands: move pillow 1 to bed 1, move pillow 1 to armchair 1",
    "Thought: The pillow goes in the armchair.\nAction: move pillow 1 to armchair 1",
)


def task(game_id: str) -> tuple[str, list[str], str]:
    """(goal, admissible commands in display order, the winning command) of one game."""
    rng = random.Random(game_id)
    obj = rng.choice(OBJECTS)
    recep, other_recep = rng.sample(RECEPTACLES, 2)
    target = f"move {obj} 1 to {recep} 1"
    commands = [target, f"go to {recep} 1", f"take {obj} 1 from {other_recep} 1", f"examine {obj} 1"]
    rng.shuffle(commands)
    return f"put a {obj} in the {recep}", commands, target


def synthetic_games(split: str, n: int, start: int = 0) -> list[Game]:
    """n games of a split; the splits use disjoint index ranges."""
    base = SPLIT_OFFSET[split]
    return [
        Game(game_id=f"choice-{base + i}", split=split, task_type=TASK_TYPE, path=Path("<synthetic>"),
             walkthrough=(task(f"choice-{base + i}")[2],))
        for i in range(start, start + n)
    ]


def synthetic_messages(task_type: str, first_observation: str, prompt_dir: str | None = None) -> list[dict]:
    """The task's own short prompt (one solved example as chat turns), not ALFWorld's."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": EXAMPLE[0]},
        {"role": "assistant", "content": EXAMPLE[1]},
        {"role": "user", "content": first_observation},
    ]


class SyntheticEnv:
    """Same interface as AlfworldEnv: reset(), step(command or None), close()."""

    def __init__(self, game: Game):
        self.game = game
        self.goal, self.commands, self.target = task(game.game_id)
        self.won = self.done = False

    def reset(self) -> StepResult:
        self.won = self.done = False
        obs = f"Your task is to: {self.goal}.\nAvailable commands: {', '.join(self.commands)}"
        return StepResult(obs, list(self.commands), False, False)

    def step(self, command: str | None) -> StepResult:
        if self.done:
            return StepResult("The episode is over.", [], self.won, True)
        if command is None or command not in self.commands:
            return StepResult(NOTHING_HAPPENS, list(self.commands), False, False)
        self.won, self.done = command == self.target, True
        return StepResult("You did it." if self.won else "That did not achieve the task.", [], self.won, True)

    def close(self) -> None:
        pass
