"""ALFWorld: game discovery and splits, the text-game env, action parsing."""

from functools import partial

from agentrl import cluster
from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import AlfworldEnv, GameLoadError, StepResult
from agentrl.env.data import Game, discover_games, resolve_data_root
from agentrl.env.pool import EnvPool, LocalEnvs, available_cores
from agentrl.env.synthetic import SyntheticEnv, synthetic_games, synthetic_messages
from agentrl.prompt import episode_messages


def env_factory(kind: str):
    """The env class of `env.kind`: alfworld (real games) or synthetic (the learning check)."""
    if kind == "synthetic":
        return SyntheticEnv
    return AlfworldEnv


def env_workers(workers: int | str, kind: str = "alfworld") -> int:
    """`env.workers` as a number. auto: one worker per core this process may use for ALFWorld;
    none for the synthetic task, whose env work is a string comparison."""
    if workers == "auto":
        return available_cores() if kind == "alfworld" else 0
    return int(workers)


def open_envs(cfg):
    """An EnvPool of `env.workers` processes, or None (envs in this process). Shut it down when done.
    With `cluster.ray_address`: the cluster is started or joined here, and the envs live in Ray
    actors (`env.workers auto` = the cluster's CPUs minus what sampler replicas and the learner reserve)."""
    if cfg.cluster.ray_address:
        cluster.connect_for(cfg)
        workers = cluster.env_actors(cfg)
        if workers <= 0:
            return None
        from agentrl.env.ray_pool import RayEnvPool  # ray: only with --ray-address

        return RayEnvPool(workers, cfg.env.kind, cfg.env.worker_timeout_s, env_overlap(cfg))
    workers = env_workers(cfg.env.workers, cfg.env.kind)
    if workers <= 0:
        return None
    return EnvPool(workers, cfg.env.kind, cfg.env.worker_timeout_s, env_overlap(cfg))


class EnvsOnDemand:
    """`open_envs(cfg)` (or envs in this process) opened at the first request: a walkthrough replay
    whose games are all in the replay cache starts no worker. Shut it down when done."""

    def __init__(self, cfg):
        self.cfg, self.opened = cfg, None

    def _envs(self):
        if self.opened is None:
            self.opened = open_envs(self.cfg) or LocalEnvs(env_factory(self.cfg.env.kind))
        return self.opened

    @property
    def workers(self) -> int:
        return self._envs().workers

    def submit(self, op: str, items: list):
        return self._envs().submit(op, items)

    def collect(self, pending) -> list:
        return self._envs().collect(pending)

    def shutdown(self) -> None:
        if self.opened is not None:
            self.opened.shutdown()


def env_overlap(cfg) -> bool:
    """env.overlap resolved: auto is on for the vLLM sampler only. Two waves mean two decode loops
    per step: a gain only where a decode loop costs less than the env work it hides. The hf
    sampler's loop costs about as much for a few rows as for many (the H100 run: 1.7-2.9 s per
    loop at 5-10% GPU use, against 0.5 s of env wait per step), and on a CPU two half
    batches decode slower than one (measured)."""
    if cfg.env.overlap != "auto":
        return bool(cfg.env.overlap)
    return cfg.sampling.backend == "vllm"


def prompt_options(cfg) -> dict:
    """ModelPolicy's prompt arguments from a config: the prompt folder, the messages for the env,
    the admissible list, the history window, the reply format and the action space (every policy a
    command builds takes these)."""
    return {"prompt_dir": cfg.prompt.dir, "messages": prompt_messages(cfg.env.kind, cfg.prompt),
            "admissible": bool(cfg.prompt.admissible), "history": cfg.prompt.history or 0,
            "reply": cfg.prompt.reply or "react", "action_space": cfg.sampling.action_space}


def prompt_messages(kind: str, prompt=None):
    """(task_type, first observation, prompt_dir) -> chat messages, for `env.kind` and the
    `prompt` config section (its example / reply variant)."""
    if kind == "synthetic":
        return synthetic_messages
    if prompt is None:
        return episode_messages
    return partial(episode_messages, example=prompt.example or "type", reply=prompt.reply or "react")


def find_games(kind: str, split: str, data=None, task_types=(), limit: int | None = None) -> list[Game]:
    """The games of a split for `env.kind` (synthetic: generated, 1000 per split unless limited)."""
    if kind == "synthetic":
        return synthetic_games(split, limit or 1000)
    return discover_games(split, data, task_types, limit)


__all__ = [
    "EnvsOnDemand",
    "env_factory",
    "env_workers",
    "find_games",
    "open_envs",
    "prompt_messages",
    "prompt_options",
    "AlfworldEnv",
    "Game",
    "GameLoadError",
    "StepResult",
    "discover_games",
    "map_action",
    "parse_action",
    "resolve_data_root",
]
