"""ALFWorld: game discovery and splits, the text-game env, action parsing."""

from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import AlfworldEnv, GameLoadError, StepResult
from agentrl.env.data import Game, discover_games, resolve_data_root

__all__ = [
    "AlfworldEnv",
    "Game",
    "GameLoadError",
    "StepResult",
    "discover_games",
    "map_action",
    "parse_action",
    "resolve_data_root",
]
