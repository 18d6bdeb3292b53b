"""One ALFWorld text game (TextWorld-PDDL engine) with alfworld's own wrappers.

An invalid command never reaches the engine: the step is a no-op that still counts
toward T_max (the paper's rule), and the agent sees ALFWorld's own "Nothing happens.".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentrl.env.data import Game

NOTHING_HAPPENS = "Nothing happens."
_WELCOME = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")


class GameLoadError(RuntimeError):
    """The engine could not load or reset a game file (reported by path; the episode is skipped)."""


@dataclass
class StepResult:
    observation: str
    admissible: list[str]
    won: bool
    done: bool


def clean_observation(text: str) -> str:
    return _WELCOME.sub("", text or "").strip()


class AlfworldEnv:
    """Load a game once; reset/step it. Not thread-safe; one per process/worker."""

    def __init__(self, game: Game):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        self.game = game
        infos = textworld.EnvInfos(won=True, admissible_commands=True)
        try:
            self._env = textworld.start(str(game.path), request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        except Exception as e:  # the engine raises many types on bad PDDL/grammar
            raise GameLoadError(f"cannot load game {game.path}: {e.__class__.__name__}: {e}") from e
        self._admissible: list[str] = []
        self.won = False

    def reset(self) -> StepResult:
        try:
            state = self._env.reset()
        except Exception as e:
            raise GameLoadError(f"cannot reset game {self.game.path}: {e.__class__.__name__}: {e}") from e
        return self._result(state, done=False)

    def step(self, command: str | None) -> StepResult:
        """Run an admissible command; None (invalid action) is a no-op that leaves the game as it was."""
        if command is None or command not in self._admissible:
            return StepResult(NOTHING_HAPPENS, list(self._admissible), self.won, self.won)
        state, _reward, done = self._env.step(command)
        return self._result(state, done=bool(done))

    def _result(self, state, done: bool) -> StepResult:
        self._admissible = list(state["admissible_commands"] or [])
        self.won = bool(state["won"])
        return StepResult(clean_observation(state.feedback), list(self._admissible), self.won, done or self.won)

    def close(self) -> None:
        self._env.close()
