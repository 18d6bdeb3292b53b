"""`agentrl eval`: held-out episodes (greedy, or N sampled per game) through the Generator;
episodes.jsonl and summary.json, a projection of the one `EvalResult`. `--split heldout` plays
both held-out splits with one loaded model: each split's files in OUT/<split> (the layout
`agentrl compare` pools), their union's summary.json in OUT."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

from agentrl.config import HELDOUT, HELDOUT_SPLITS, Config, effective_prompt
from agentrl.env import find_games
from agentrl.io import atomic_write_json, atomic_write_jsonl
from agentrl.machine import machine
from agentrl.rollout.generator import EvalResult, Generator
from agentrl.rollout.lockstep import summed_stats
from agentrl.rollout.plan import check_kv_fits
from agentrl.weights import weights_digest

__all__ = ["EvalResult", "eval_splits", "prepare_eval", "run_eval", "run_evals", "summary"]


def summary(result: EvalResult, cfg: Config) -> dict:
    """summary.json: the run's settings, the result's blocks, its timing and its env errors."""
    trajs, stats = result.trajectories, result.stats
    return {
        "prompt": effective_prompt(cfg),
        "split": result.split,
        "policy": cfg.eval.policy,
        "model": cfg.model.name if cfg.eval.policy == "model" else None,
        "adapter": cfg.model.adapter if cfg.eval.policy == "model" else None,
        # the adapter's bytes: results pair on the same weights only where these agree
        "adapter_sha256": adapter_sha256(cfg.model.adapter) if cfg.eval.policy == "model" and cfg.model.adapter else None,
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
        "machine": machine(cfg),  # the dtype it ran at and where: `agentrl compare` warns across numerics
        **({"walkthroughs": walkthrough_outcomes(result)} if cfg.eval.policy == "walkthrough" else {}),
    }


@cache
def _digest(adapter: str) -> tuple:
    return tuple(weights_digest(adapter).items())


def adapter_sha256(adapter: str) -> dict[str, str]:
    """`weights_digest`, read once per process: `--split heldout` writes three summaries of one
    adapter, and a weights directory never changes once written (weights.py's contract)."""
    return dict(_digest(str(adapter)))


def walkthrough_outcomes(result: EvalResult) -> dict:
    """`--policy walkthrough`: the games whose walkthrough wins (playable: the warm start learns
    from them) and those whose walkthrough does not, within T_max or at all (agentrl sft skips them)."""
    lost = [t for t in result.trajectories if not t.won and not t.error]
    too_long = [t.game.game_id for t in lost if len(t.game.walkthrough) > result.max_steps]
    return {"won": sum(t.won for t in result.trajectories),
            "unwinnable": [t.game.game_id for t in lost if len(t.game.walkthrough) <= result.max_steps],
            "longer_than_t_max": too_long}


def eval_splits(cfg: Config) -> tuple[str, ...]:
    """The splits an eval plays: eval.split, or both held-out splits for `heldout`."""
    return HELDOUT_SPLITS if cfg.eval.split == HELDOUT else (cfg.eval.split,)


def prepare_eval(cfg: Config) -> tuple[dict[str, list], Generator]:
    """({split: games}, generator): everything that can fail on bad input, before any episode runs
    (every split's games are found before the model loads)."""
    games = {split: find_games(cfg.env.kind, split, cfg.data.root, cfg.eval.task_types, cfg.eval.limit)
             for split in eval_splits(cfg)}
    if cfg.eval.policy == "model":  # one episode's KV must fit (more are run in slices)
        check_kv_fits(cfg, 1, cfg.t_max("eval"), "eval")
    return games, Generator(cfg, walkthrough=cfg.eval.policy == "walkthrough")


def run_eval(cfg: Config, out: Path | None = None, games=None, generator: Generator | None = None, on_step=None,
             on_reset=None) -> EvalResult:
    """Run cfg.eval's episodes on one split; write episodes.jsonl and summary.json into `out`. The
    generator (from `prepare_eval`, made here if not given) is closed when done."""
    if games is None or generator is None:
        found, generator = prepare_eval(cfg)
        games = found[cfg.eval.split]
    with generator:
        return _play(cfg, out, games, generator, on_step, on_reset)


def run_evals(cfg: Config, out: Path | None, games: dict[str, list], generator: Generator, on_split=None,
              on_step=None, on_reset=None) -> dict[str, EvalResult]:
    """Each split's episodes with one generator (closed when done). One split: as `run_eval`.
    Several (`heldout`): split S's files in out/S, then the union's result, under the key
    cfg.eval.split, with its summary.json in `out`. `on_split(split, games)` before each split."""
    results: dict[str, EvalResult] = {}
    with generator:
        for split, split_games in games.items():
            if on_split is not None:
                on_split(split, len(split_games))
            one = replace(cfg, eval=replace(cfg.eval, split=split))
            where = out if out is None or len(games) == 1 else out / split
            results[split] = _play(one, where, split_games, generator, on_step, on_reset)
    if len(games) > 1:
        results[cfg.eval.split] = union = _union(cfg.eval.split, list(results.values()))
        if out is not None:  # no episodes.jsonl here: `agentrl compare OUT` reads the splits' own
            atomic_write_json(out / "summary.json", summary(union, cfg))
    return results


def _play(cfg: Config, out: Path | None, games: list, generator: Generator, on_step, on_reset) -> EvalResult:
    result = generator.evaluate(games, cfg.eval.split, cfg.t_max("eval"), cfg.eval.samples, on_step, on_reset)
    if out is not None:
        rows = [t.summary() | {"responses": [s.response for s in t.steps]} for t in result.trajectories]
        atomic_write_jsonl(out / "episodes.jsonl", rows)
        atomic_write_json(out / "summary.json", summary(result, cfg))
    return result


def _union(split: str, results: list[EvalResult]) -> EvalResult:
    """Evaluations run one after another as one: their episodes together, their costs summed."""
    first, stats = results[0], summed_stats([r.stats for r in results])
    return EvalResult(split, first.max_steps, [t for r in results for t in r.trajectories], stats, first.samples,
                      first.seed, sum(r.elapsed_s for r in results), results[-1].memory)
