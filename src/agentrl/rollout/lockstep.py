"""Lockstep runner: every live trajectory takes step t together.

Per step: ONE batched generate over all live trajectories (the policy's `act`), parse and
map each action, step every env, append the observation. Finished trajectories leave the
batch. An env that fails to load or step marks only its own trajectory (env_error).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import AlfworldEnv, GameLoadError, StepResult
from agentrl.env.data import Game
from agentrl.prompt import ChatRenderer, episode_messages
from agentrl.rollout.trajectory import Step, Trajectory
from agentrl.sampling.base import Sampler, SamplingParams

log = logging.getLogger(__name__)


def row_seed(run_seed: int, game_id: str, index: int, step: int) -> int:
    """Seed of one generate call of one trajectory: same (seed, task, trajectory, step) -> same sample."""
    key = f"{run_seed}|{game_id}|{index}|{step}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@dataclass
class RolloutStats:
    env_steps: int = 0
    step_tokens: int = 0  # generated (action) tokens
    generate_s: float = 0.0
    env_s: float = 0.0
    wall_s: float = 0.0


class ModelPolicy:
    """Acts by sampling from a Sampler; builds each trajectory's exact tokens as it goes."""

    def __init__(self, sampler: Sampler, params: SamplingParams, seed: int = 0, prompt_dir: str | None = None):
        self.sampler, self.params, self.seed, self.prompt_dir = sampler, params, seed, prompt_dir
        self.renderer = ChatRenderer(sampler.tokenizer)
        self._stopped: dict[int, bool] = {}

    def start(self, traj: Trajectory) -> None:
        messages = episode_messages(traj.game.task_type, traj.initial_observation, self.prompt_dir)
        traj.append(self.renderer.initial(messages), generated=False)

    def act(self, trajs: list[Trajectory]) -> list[str]:
        seeds = [row_seed(self.seed, t.game.game_id, t.index, len(t.steps)) for t in trajs]
        keys = [(t.game.game_id, t.index) for t in trajs]
        completions = self.sampler.generate([t.token_ids for t in trajs], self.params, seeds, keys)
        for t, c in zip(trajs, completions):
            t.append(c.token_ids, generated=True, logprobs=c.logprobs)
            t.step_tokens.append(len(c.token_ids))
            self._stopped[id(t)] = c.finish_reason == "stop"
        return [c.text for c in completions]

    def observe(self, traj: Trajectory, observation: str) -> None:
        traj.append(self.renderer.observation(observation, self._stopped.pop(id(traj), False)), generated=False)


class WalkthroughPolicy:
    """Replays each game's own expert walkthrough (checks an ALFWorld install: must win every game)."""

    def start(self, traj: Trajectory) -> None:
        pass

    def act(self, trajs: list[Trajectory]) -> list[str]:
        out = []
        for t in trajs:
            w = t.game.walkthrough
            out.append(f"Action: {w[len(t.steps)]}" if len(t.steps) < len(w) else "")
        return out

    def observe(self, traj: Trajectory, observation: str) -> None:
        pass


def run_lockstep(
    games: list[Game],
    policy,
    max_steps: int,
    fuzzy_threshold: float = 85.0,
    group_size: int = 1,
    on_step: Callable[[int, list[Trajectory]], None] | None = None,
    on_reset: Callable[[int, int], None] | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """Roll out `group_size` trajectories per game, all in lockstep; return them and the accounting."""
    stats = RolloutStats()
    wall = time.perf_counter()
    trajs = [Trajectory(game=g, index=i) for g in games for i in range(group_size)]
    envs: dict[int, AlfworldEnv] = {}
    t0 = time.perf_counter()
    for k, traj in enumerate(trajs):
        try:
            env = AlfworldEnv(traj.game)
            first = env.reset()
        except GameLoadError as e:
            traj.stop_reason, traj.error = "env_error", str(e)
            log.warning("%s", e)
            continue
        envs[k] = env
        traj.initial_observation, traj.admissible = first.observation, first.admissible
        policy.start(traj)
        if on_reset is not None:
            on_reset(k + 1, len(trajs))
    stats.env_s += time.perf_counter() - t0

    for step in range(max_steps):
        live = [k for k, t in enumerate(trajs) if not t.done]
        if not live:
            break
        t0 = time.perf_counter()
        responses = policy.act([trajs[k] for k in live])
        stats.generate_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for k, response in zip(live, responses):
            traj = trajs[k]
            action = parse_action(response)
            command, score = map_action(action, traj.admissible, fuzzy_threshold)
            try:
                result: StepResult = envs[k].step(command)
            except Exception as e:  # the engine itself failed: this trajectory only
                traj.stop_reason, traj.error = "env_error", f"{e.__class__.__name__}: {e}"
                continue
            stats.env_steps += 1
            traj.steps.append(Step(response, action, command, result.observation, result.won, result.done, score))
            traj.admissible = result.admissible
            if result.won:
                traj.stop_reason = "won"
            elif len(traj.steps) >= max_steps:
                traj.stop_reason = "max_steps"
            else:
                policy.observe(traj, result.observation)
        stats.env_s += time.perf_counter() - t0
        if on_step is not None:
            on_step(step + 1, trajs)
    for traj in trajs:
        if traj.stop_reason is None:  # max_steps == 0 or every remaining one ran out
            traj.stop_reason = "max_steps"
    for env in envs.values():
        env.close()
    stats.step_tokens = sum(sum(t.step_tokens) for t in trajs)
    stats.wall_s = time.perf_counter() - wall
    return trajs, stats
