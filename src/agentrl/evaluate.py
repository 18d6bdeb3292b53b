"""`agentrl eval`: held-out episodes (greedy, or N sampled per game) through the Generator;
episodes.jsonl and summary.json, a projection of the one `EvalResult`."""

from __future__ import annotations

from pathlib import Path

from agentrl.config import Config, effective_prompt
from agentrl.env import find_games
from agentrl.io import atomic_write_json, atomic_write_jsonl
from agentrl.rollout.generator import EvalResult, Generator
from agentrl.rollout.plan import check_kv_fits

__all__ = ["EvalResult", "prepare_eval", "run_eval", "summary"]


def summary(result: EvalResult, cfg: Config) -> dict:
    """summary.json: the run's settings, the result's blocks, its timing and its env errors."""
    trajs, stats = result.trajectories, result.stats
    return {
        "prompt": effective_prompt(cfg),
        "split": result.split,
        "policy": cfg.eval.policy,
        "model": cfg.model.name if cfg.eval.policy == "model" else None,
        "adapter": cfg.model.adapter if cfg.eval.policy == "model" else None,
        "max_steps": result.max_steps,
        "samples": result.samples,  # 0: greedy
        "temperature": cfg.sampling.temperature if result.samples else 0.0,
        "seed": result.seed,
        "overall": result.overall,
        "by_task_type": result.by_task_type,
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
        **({"memory": result.memory} if result.memory else {}),
        "errors": [{"task_id": t.game.game_id, "error": t.error} for t in trajs if t.error],
        **({"walkthroughs": walkthrough_outcomes(result)} if cfg.eval.policy == "walkthrough" else {}),
    }


def walkthrough_outcomes(result: EvalResult) -> dict:
    """`--policy walkthrough`: the games whose walkthrough wins (playable: the warm start learns
    from them) and those whose walkthrough does not, within T_max or at all (agentrl sft skips them)."""
    lost = [t for t in result.trajectories if not t.won and not t.error]
    too_long = [t.game.game_id for t in lost if len(t.game.walkthrough) > result.max_steps]
    return {"won": sum(t.won for t in result.trajectories),
            "unwinnable": [t.game.game_id for t in lost if len(t.game.walkthrough) <= result.max_steps],
            "longer_than_t_max": too_long}


def prepare_eval(cfg: Config) -> tuple[list, Generator]:
    """(games, generator): everything that can fail on bad input, before any episode runs."""
    games = find_games(cfg.env.kind, cfg.eval.split, cfg.data.root, cfg.eval.task_types, cfg.eval.limit)
    if cfg.eval.policy == "model":  # one episode's KV must fit (more are run in slices)
        check_kv_fits(cfg, 1, cfg.t_max("eval"), "eval")
    return games, Generator(cfg, walkthrough=cfg.eval.policy == "walkthrough")


def run_eval(cfg: Config, out: Path | None = None, games=None, generator: Generator | None = None, on_step=None,
             on_reset=None) -> EvalResult:
    """Run cfg.eval's episodes; write episodes.jsonl and summary.json into `out`. The generator
    (from `prepare_eval`, made here if not given) is closed when done."""
    if games is None or generator is None:
        games, generator = prepare_eval(cfg)
    with generator:
        result = generator.evaluate(games, cfg.eval.split, cfg.t_max("eval"), cfg.eval.samples, on_step, on_reset)
    if out is not None:
        rows = [t.summary() | {"responses": [s.response for s in t.steps]} for t in result.trajectories]
        atomic_write_jsonl(out / "episodes.jsonl", rows)
        atomic_write_json(out / "summary.json", summary(result, cfg))
    return result
