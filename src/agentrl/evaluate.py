"""Greedy held-out evaluation: all tasks stepped together, success by task type."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from agentrl.config import Config, effective_prompt
from agentrl.env import env_factory, find_games, open_envs, prompt_options
from agentrl.io import atomic_write_json, atomic_write_jsonl
from agentrl.rollout import ModelPolicy, RolloutStats, Trajectory, WalkthroughPolicy, run_in_slices
from agentrl.rollout.trajectory import behaviour_metrics, played, played_or_stop
from agentrl.sampling import make_sampler
from agentrl.sampling.base import SamplingParams
from agentrl.stats import bootstrap_mean, wilson


@dataclass
class EvalResult:
    trajectories: list[Trajectory]
    stats: RolloutStats
    summary: dict


def build_policy(cfg: Config, sampler=None):
    if cfg.eval.policy == "walkthrough":
        return WalkthroughPolicy()
    sampler = sampler or make_sampler(cfg)
    if cfg.eval.samples:  # N episodes per game at the training temperature (the field's habit besides greedy)
        params = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens)
    else:
        params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=cfg.sampling.max_new_tokens)
    return ModelPolicy(sampler, params, seed=cfg.seed, **prompt_options(cfg))


def summarize(trajs: list[Trajectory], stats: RolloutStats, cfg: Config) -> dict:
    by_type: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_type[t.game.task_type].append(t)

    def block(all_ts: list[Trajectory]) -> dict:
        ts = played(all_ts)  # an episode the env could not run is no outcome: not in n, won or the interval
        n, won = len(ts), sum(t.won for t in ts)
        return {
            "episodes": n,
            "games": len({t.game.game_id for t in ts}),
            "won": won,
            "success_rate": won / n if n else 0.0,
            # 95% interval of the success rate: Wilson for one episode per game; with N sampled
            # episodes per game they are not independent, so a percentile bootstrap over games
            "ci95": list(wilson(won, n) or (0.0, 0.0)) if not cfg.eval.samples else game_bootstrap(ts, cfg.seed),
            "mean_steps": sum(len(t.steps) for t in ts) / n if n else 0.0,
            "invalid_actions_per_episode": sum(t.invalid_actions for t in ts) / n if n else 0.0,
            "env_errors": len(all_ts) - n,
            **{k: v for k, v in behaviour_metrics(ts).items() if k in ("valid_action_rate", "mean_reply_tokens", "replies_cut_rate")},
        }

    return {
        "prompt": effective_prompt(cfg),
        "split": cfg.eval.split,
        "policy": cfg.eval.policy,
        "model": cfg.model.name if cfg.eval.policy == "model" else None,
        "adapter": cfg.model.adapter if cfg.eval.policy == "model" else None,
        "max_steps": cfg.eval.max_steps or cfg.env.max_steps,
        "samples": cfg.eval.samples,  # 0: greedy
        "temperature": cfg.sampling.temperature if cfg.eval.samples else 0.0,
        "seed": cfg.seed,
        "overall": block(trajs),
        "by_task_type": {k: block(v) for k, v in sorted(by_type.items())},
        "timing": {
            "wall_s": stats.wall_s,
            "generate_s": stats.generate_s,
            "env_s": stats.env_s,
            "env_steps": stats.env_steps,
            "step_tokens": stats.step_tokens,
            "s_per_step": stats.wall_s / max(1, max(len(t.steps) for t in trajs)),
            "s_per_env_step": stats.wall_s / max(1, stats.env_steps),
            "s_per_task": stats.wall_s / max(1, len(trajs)),
        },
        "errors": [{"task_id": t.game.game_id, "error": t.error} for t in trajs if t.error],
    }


def game_bootstrap(ts: list[Trajectory], seed: int, draws: int = 2000) -> list[float]:
    """95% percentile bootstrap of the mean success, resampling games (each with all its episodes)."""
    by_game: dict[str, list[float]] = defaultdict(list)
    for t in ts:
        by_game[t.game.game_id].append(float(t.won))
    return bootstrap_mean([sum(v) / len(v) for v in by_game.values()], seed, draws)


def prepare_eval(cfg: Config, sampler=None):
    """(games, policy): everything that can fail on bad input, before any episode runs."""
    games = find_games(cfg.env.kind, cfg.eval.split, cfg.data.root, cfg.eval.task_types, cfg.eval.limit)
    if cfg.eval.policy == "model" and sampler is None:  # one episode's KV must fit (more are run in slices)
        from agentrl.rollout.plan import check_kv_fits

        check_kv_fits(cfg, 1, cfg.eval.max_steps or cfg.env.max_steps, "eval")
    return games, build_policy(cfg, sampler)


def slice_size(cfg: Config, policy, n_games: int, max_steps: int) -> int | None:
    """Games an evaluation steps together: all (None), or as many as the sampler's KV budget holds
    at once; the rest follow in further slices (greedy episodes do not interact: same results)."""
    sampler = getattr(policy, "sampler", None)
    if sampler is None or cfg.env.kind != "alfworld":
        return None
    from agentrl.rollout.plan import expected_context_tokens

    fit = sampler.rows_that_fit(expected_context_tokens(cfg, max_steps, sampler.tokenizer))
    if fit is None:  # the backend manages its own KV memory
        return None
    rows = max(1, fit)
    return rows if rows < n_games else None


def run_eval(cfg: Config, out: Path | None = None, games=None, policy=None, on_step=None, on_reset=None) -> EvalResult:
    """Run greedy episodes on cfg.eval's split; write episodes.jsonl and summary.json into `out`."""
    if games is None or policy is None:
        games, policy = prepare_eval(cfg)
    max_steps = cfg.eval.max_steps or cfg.env.max_steps
    envs = open_envs(cfg)  # env worker processes (env.workers), or None
    try:
        per_game = max(1, cfg.eval.samples)
        size = slice_size(cfg, policy, len(games) * per_game, max_steps)
        rollout = run_in_slices(games, size and max(1, size // per_game), policy=policy, max_steps=max_steps,
                                fuzzy_threshold=cfg.env.fuzzy_threshold, on_step=on_step, on_reset=on_reset,
                                make_env=env_factory(cfg.env.kind), envs=envs, group_size=per_game)
    finally:
        if envs is not None:
            envs.shutdown()
    trajs, stats = rollout.trajectories, rollout.stats
    played_or_stop(trajs, "episodes, nothing was evaluated")
    summary = summarize(trajs, stats, cfg)
    if out is not None:
        rows = [t.summary() | {"responses": [s.response for s in t.steps]} for t in trajs]
        atomic_write_jsonl(out / "episodes.jsonl", rows)
        atomic_write_json(out / "summary.json", summary)
    return EvalResult(trajs, stats, summary)
