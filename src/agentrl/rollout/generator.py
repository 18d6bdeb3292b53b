"""The Generator: the rollout side of a run, built once from the config.

It owns the sampler engine (`make_sampler`, unless the caller passes one), the policies it
acts with (`ModelPolicy` / `WalkthroughPolicy` with their `SamplingParams`: built here and
nowhere else) and the env backend (env worker processes or envs in this process). The caller
owns the step stages (the gate, ARRoL) and hands them to each `generate`, so this module stays
below select/ and train/ (tests/test_imports.py).

    gen = Generator(cfg)                                   # envs start while the model loads
    rollout = gen.generate(tasks, G, seed, stages)         # B x G trajectories in lockstep -> groups
    result = gen.evaluate(games, split, T_max)             # greedy episodes -> one EvalResult
    gen.load(weights)                                      # serve the learner's new weights
    gen.close()                                            # env workers down, an owned sampler closed

Contract: `generate` and `evaluate` are deterministic given the weights served, the games,
the seed and the config (per-row seeds: the batch, the env workers and the eval slices change
timings only). `load` takes effect from the next generate on. After `close` the generator is
not used again.

`agentrl eval` writes a projection of `EvalResult` (evaluate.py: summary.json); train's
in-training evals write another (train/loop.py: `eval_row`). Both read the same record.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from agentrl.config import Config
from agentrl.env import env_factory, open_envs, prompt_options
from agentrl.env.data import Game
from agentrl.env.pool import LocalEnvs
from agentrl.errors import UserError
from agentrl.rollout.plan import expected_context_tokens
from agentrl.rollout.lockstep import (LockstepConfig, ModelPolicy, Progress, Rollout, RolloutStats, WalkthroughPolicy,
                                      lockstep, run_in_slices)
from agentrl.rollout.trajectory import Trajectory, behaviour_metrics, played, played_or_stop
from agentrl import sampling  # sampling.make_sampler looked up at call time: tests script the sampler there
from agentrl.sampling.base import Sampler, SamplingParams
from agentrl.sampling.budget import peak_rss_bytes
from agentrl.stats import bootstrap_mean, wilson
from agentrl.weights import WeightsRef

# (games, group_size, first_index, stages) -> Rollout: what the selection stages roll out with
RollFn = Callable[[list[Game], int, int, list], Rollout]


@dataclass
class EvalResult:
    """One evaluation: its episodes and their outcome, overall and per task type. The one record
    `agentrl eval`'s summary.json and train's eval rows in metrics.jsonl are projections of.

    An episode the env could not run (env_error) is no outcome: it is in `trajectories` but not
    in the blocks' episodes, wins or intervals (`env_errors` counts it)."""

    split: str
    max_steps: int  # T_max of these episodes
    trajectories: list[Trajectory]
    stats: RolloutStats
    samples: int = 0  # N episodes per game sampled at the training temperature; 0: one greedy episode
    seed: int = 0
    elapsed_s: float = 0.0  # the whole evaluation, policy construction included
    memory: dict | None = None  # what it planned and held (`Generator.memory`); None for a walkthrough eval

    @cached_property
    def overall(self) -> dict:
        return self.block(self.trajectories)

    @cached_property
    def by_task_type(self) -> dict[str, dict]:
        by_type: dict[str, list[Trajectory]] = defaultdict(list)
        for t in self.trajectories:
            by_type[t.game.task_type].append(t)
        return {k: self.block(v) for k, v in sorted(by_type.items())}

    def block(self, all_ts: list[Trajectory]) -> dict:
        ts = played(all_ts)
        n, won = len(ts), sum(t.won for t in ts)
        return {
            "episodes": n,
            "games": len({t.game.game_id for t in ts}),
            "won": won,
            "success_rate": won / n if n else 0.0,
            # 95% interval of the success rate: Wilson for one episode per game; with N sampled
            # episodes per game they are not independent, so a percentile bootstrap over games
            "ci95": list(wilson(won, n) or (0.0, 0.0)) if not self.samples else game_bootstrap(ts, self.seed),
            "mean_steps": sum(len(t.steps) for t in ts) / n if n else 0.0,
            "invalid_actions_per_episode": sum(t.invalid_actions for t in ts) / n if n else 0.0,
            "env_errors": len(all_ts) - n,
            **{k: v for k, v in behaviour_metrics(ts).items()
               if k in ("valid_action_rate", "mean_reply_tokens", "replies_cut_rate", "looped_rate", "other_object_rate",
                       "guarded_rate")},
        }


def game_bootstrap(ts: list[Trajectory], seed: int, draws: int = 2000) -> list[float]:
    """95% percentile bootstrap of the mean success, resampling games (each with all its episodes)."""
    by_game: dict[str, list[float]] = defaultdict(list)
    for t in ts:
        by_game[t.game.game_id].append(float(t.won))
    return bootstrap_mean([sum(v) / len(v) for v in by_game.values()], seed, draws)


class Generator:
    """The rollout side: sampler engine, policies, env backend (see the module docstring).

    `sampler`: a sampler the caller owns (kept open at close); None: one made from the config
    (closed at close). `walkthrough`: act by replaying each game's expert walkthrough (no model
    is loaded). `colocated`: a learner shares the sampler's device (train's colocate layout)."""

    def __init__(self, cfg: Config, sampler: Sampler | None = None, *, walkthrough: bool = False, colocated: bool = False):
        self.cfg, self.walkthrough = cfg, walkthrough
        # env worker processes (they start while the model loads), or the envs in this process
        pool = open_envs(cfg)
        self.envs = pool if pool is not None else LocalEnvs(env_factory(cfg.env.kind))
        self._owns_sampler = sampler is None and not walkthrough
        try:
            self.sampler = sampler if sampler is not None or walkthrough else sampling.make_sampler(cfg, colocated=colocated)
        except BaseException:
            self.close()
            raise
        self._policy: tuple[tuple, object] | None = None  # the last policy built, by (seed, greedy)

    # ---------------------------------------------------------------- policies
    def policy(self, seed: int, greedy: bool = False):
        """The policy the rollouts act with: the sampler at the run's sampling settings (greedy:
        temperature 0), seeded with `seed`; the walkthrough replay for a walkthrough generator."""
        if self.walkthrough:
            return WalkthroughPolicy()
        if self._policy is None or self._policy[0] != (seed, greedy):
            s = self.cfg.sampling
            params = SamplingParams(0.0, 1.0, s.max_new_tokens) if greedy else SamplingParams(s.temperature, s.top_p, s.max_new_tokens)
            self._policy = ((seed, greedy), ModelPolicy(self.sampler, params, seed=seed, loop_guard=s.loop_guard,
                                                      **prompt_options(self.cfg)))
        return self._policy[1]

    # ---------------------------------------------------------------- rollouts
    def generate(self, tasks: list[Game], group_size: int | None = None, seed: int | None = None, stages=(),
                 first_index: int = 0, on_step=None, on_reset=None) -> Rollout:
        """`group_size` (default rollout.group_size) trajectories per task, all in lockstep, at the
        rollout T_max; `stages` (the gate, ARRoL) act right after their step K. `seed`: the
        sampling seed (default the run seed); `first_index` > 0 adds trajectories to a group."""
        cfg, t_max = self.cfg, self.cfg.t_max("rollout")
        run = LockstepConfig(t_max, cfg.env.fuzzy_threshold, group_size or cfg.rollout.group_size,
                             tuple(k for k in cfg.rollout.signal_steps if k <= t_max), first_index)
        policy = self.policy(cfg.seed if seed is None else seed)
        self._reserve(len(tasks) * run.group_size, t_max)
        return lockstep(tasks, policy, run, self.envs, stages, Progress(on_step, on_reset))

    def roller(self, seed: int, on_step=None) -> RollFn:
        """`generate` as the selection stages call it: (games, group_size, first_index, stages)."""
        def roll(games, group_size=None, first_index=0, stages=()):
            return self.generate(games, group_size, seed, stages, first_index, on_step)

        return roll

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, games: list[Game], split: str, max_steps: int, samples: int = 0, on_step=None,
                 on_reset=None, what: str = "episodes") -> EvalResult:
        """Episodes on `games`: one greedy episode each, or `samples` at the training temperature.
        Run in slices when the sampler's KV budget cannot hold them all at once, or of `eval.rows`.
        Episodes of different games share only their batches, but that moves reduced-precision
        numerics: a greedy bf16 eval sliced otherwise can end a game differently (one of 134,
        docs/measurements/evaluation-repeats.md). Refuses when the env ran none of them (`what` names them in that message)."""
        t0 = time.perf_counter()
        policy = self.policy(self.cfg.seed, greedy=not samples)
        per_game = max(1, samples)
        rows = len(games) * per_game
        size = self.slice_size(rows, max_steps)
        self._reserve(size or rows, max_steps)
        run = LockstepConfig(max_steps, self.cfg.env.fuzzy_threshold, per_game)
        rollout = run_in_slices(games, size and max(1, size // per_game), policy, run, self.envs, Progress(on_step, on_reset))
        played_or_stop(rollout.trajectories, f"{what}, nothing was evaluated")
        memory = self.memory(size or rows, max_steps)  # slice_size: fewer than rows, or None (all together)
        return EvalResult(split, max_steps, rollout.trajectories, rollout.stats, samples, self.cfg.seed,
                          time.perf_counter() - t0, memory)

    def memory(self, rows: int, max_steps: int) -> dict | None:
        """What an evaluation of `rows` episodes stepped together planned and held: the KV plan
        (rows x the expected tokens per row), the sampler's KV store at its peak, and the peak
        resident memory of this process and of the env workers (VmHWM: the whole run so far).
        Written to summary.json, so the plan can be checked against what a run held."""
        if self.sampler is None:
            return None
        kv = self.sampler.kv_memory()
        out = {"rows_together": rows, "peak_rss_bytes": peak_rss_bytes(),
               "env_workers_peak_rss_bytes": sum(peak_rss_bytes(p) for p in self.envs.pids)}
        if kv is not None:
            tokens = expected_context_tokens(self.cfg, max_steps, self.sampler.tokenizer)
            out |= {"kv_planned_bytes": rows * tokens * kv["bytes_per_token"], "tokens_per_row_planned": tokens,
                    **{f"kv_{k}": v for k, v in kv.items()}}
        return out

    def _reserve(self, rows: int, max_steps: int) -> None:
        """Tell the sampler the plan before a lockstep run: `rows` trajectories of up to the expected
        tokens of `max_steps` steps (its KV store is then sized once, not grown and copied as the rows grow)."""
        if self.sampler is not None and self.cfg.env.kind == "alfworld":
            self.sampler.reserve(rows, expected_context_tokens(self.cfg, max_steps, self.sampler.tokenizer))

    def slice_size(self, rows: int, max_steps: int) -> int | None:
        """Episodes an evaluation steps together: all (None), or as many as the sampler's KV budget
        holds at once (auto), or `eval.rows`, refused where the budget cannot hold them; the rest
        follow in further slices."""
        fixed = self.cfg.eval.rows
        planned = self.sampler is not None and self.cfg.env.kind == "alfworld"  # else nothing to plan: all, or fixed
        tokens = expected_context_tokens(self.cfg, max_steps, self.sampler.tokenizer) if planned else None
        fit = self.sampler.rows_that_fit(tokens) if planned else None  # None: the backend manages its own KV memory
        if fixed and fit is not None and fit < min(fixed, rows):
            raise UserError(f"eval.rows {fixed}: the sampler's KV budget holds {max(fit, 0)} episodes of ~{tokens} "
                            f"tokens at once (sampling.kv_budget_gb {self.cfg.sampling.kv_budget_gb}): lower --rows or "
                            "raise sampling.kv_budget_gb")
        if not fixed and fit is None:
            return None
        n = fixed or max(1, fit)
        return n if n < rows else None

    # ---------------------------------------------------------------- weights and lifecycle
    def load(self, weights: WeightsRef) -> None:
        """Serve `weights` from the next generate on (the base model stays resident)."""
        self.sampler.load(weights)

    def close(self) -> None:
        """Shut the env workers down and close a sampler this generator made (replicas hold GPUs)."""
        envs, self.envs = self.envs, None
        if envs is not None:
            envs.shutdown()
        sampler = getattr(self, "sampler", None) if self._owns_sampler else None  # unset if make_sampler failed
        if sampler is not None:
            sampler.close()  # Ray sampler replicas free their GPUs; in-process samplers hold nothing

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
