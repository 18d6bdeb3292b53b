"""`agentrl rollout`: B tasks x G trajectories with the gate; trajectories.jsonl + groups.csv.

`--tier1-ab` (the paper's Tier 1): the same tasks twice with the same seeds, baseline (no
gate) and gated, and the Table 3 analogue comparing the two arms.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as sps

from agentrl.config import Config
from agentrl.env import find_games
from agentrl.errors import UserError
from agentrl.io import atomic_write_json, atomic_write_text
from agentrl.rollout import SIGNALS, Rollout, merge_rollouts
from agentrl.rollout.generator import Generator
from agentrl.rollout.plan import check_kv_fits
from agentrl.sampling.base import GenRequest, SamplingParams
from agentrl.select.cut import CutStage
from agentrl.specs import GateSpec
from agentrl.stats import wilson

GROUP_COLUMNS = ["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated", "step_tokens"]


def prepare_rollout(cfg: Config) -> tuple[list, Generator]:
    """(games, generator): everything that can fail on bad input, before any episode runs."""
    games = load_games(cfg)
    check_kv_fits(cfg, round_size(cfg, len(games)) * cfg.rollout.group_size, cfg.t_max("rollout"), "rollout")
    return games, Generator(cfg)


def run_rollout(cfg: Config, games, generator: Generator, out: Path, tier1_ab: bool = False, progress=None):
    """`agentrl rollout`: the gated rollout (or, with `tier1_ab`, the Tier 1 A/B) written into
    `out`; returns the Rollout (or the Tier1). The generator is closed when done."""
    gate = cfg.rollout.parsed_gate()
    with generator:
        if not tier1_ab:
            rollout = roll_rounds(cfg, games, generator, make_cut_stage(cfg, gate), progress)
            write_rollout(rollout, out, cfg.rollout.signal_steps)
            return rollout
        result = run_tier1(cfg, games, generator, gate, progress)
    for name, r in (("baseline", result.baseline), ("gated", result.gated)):
        write_rollout(r, out / name, cfg.rollout.signal_steps)
    atomic_write_json(out / "tier1.json", result.report)
    atomic_write_text(out / "tier1.md", tier1_markdown(result.report))
    return result


def roll_rounds(cfg: Config, games, generator: Generator, stage: CutStage | None, progress=None,
                name: str = "rollout") -> Rollout:
    """`agentrl rollout`: the tasks in `rollout.rounds` consecutive lockstep rounds (at most
    ceil(B / rounds) tasks each), merged. The gate stage (`make_cut_stage`) lives across the
    rounds: an auto gate learns from each round's finished groups and re-fits before the next."""
    size = round_size(cfg, len(games))
    n = -(-len(games) // size)
    parts = []
    for r, start in enumerate(range(0, len(games), size), start=1):
        label = name if n == 1 else f"{name} {r}/{n}"
        if stage is not None:
            stage.begin(r)
        on_step, on_reset = progress(label) if progress else (None, None)
        part = generator.generate(games[start:start + size], stages=[stage] if stage is not None else [],
                                  on_step=on_step, on_reset=on_reset)
        if stage is not None:
            stage.observe(part.groups)
        parts.append(part)
    return merge_rollouts(parts)


def round_size(cfg: Config, tasks: int) -> int:
    """Tasks per `agentrl rollout` round (the rows one lockstep holds are this x G)."""
    return -(-tasks // cfg.rollout.rounds)


def make_cut_stage(cfg: Config, gate: GateSpec | None) -> CutStage | None:
    """The gate as a stage, with the run's audit rate (an auto gate's labels)."""
    return CutStage.from_spec(gate, cfg.select.gate_audit, cfg.seed, cfg.gate) if gate is not None else None


def groups_table(rollout: Rollout) -> list[dict]:
    """One row per (group, K). A cut group has rows only up to its cut step (later prefixes do not exist)."""
    rows = []
    for g in rollout.groups:
        for K in sorted(g.signals):
            rows.append({
                "task_id": g.game.game_id, "task_type": g.game.task_type, "K": K,
                **{name: round(g.signals[K][name], 6) for name in SIGNALS},
                "rewards": ";".join(f"{r:g}" for r in g.rewards), "cut": int(g.cut),
                "steps_generated": g.env_steps, "step_tokens": g.step_tokens,
            })
    return rows


def write_rollout(rollout: Rollout, out: Path, signal_steps) -> None:
    lines = []
    for g in rollout.groups:
        for t in g.trajectories:
            lines.append(json.dumps(t.record() | {"group_cut": g.cut, "group_cut_step": g.cut_step}))
    atomic_write_text(out / "trajectories.jsonl", "\n".join(lines) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=GROUP_COLUMNS)
    writer.writeheader()
    writer.writerows(r for r in groups_table(rollout) if r["K"] in set(signal_steps))
    atomic_write_text(out / "groups.csv", buf.getvalue())
    atomic_write_json(out / "summary.json", rollout_summary(rollout))


def rollout_summary(rollout: Rollout) -> dict:
    s, groups = rollout.stats, rollout.groups
    return {
        "groups": len(groups),
        "trajectories": len(rollout.trajectories),
        "groups_cut": sum(g.cut for g in groups),
        "zero_variance_groups": sum(g.zero_variance for g in groups),
        "success_rate": float(np.mean([t.reward for t in rollout.trajectories])),
        "wall_s": s.wall_s, "generate_s": s.generate_s, "env_s": s.env_s,
        "env_steps": s.env_steps, "step_tokens": s.step_tokens,
        "per_group": [
            {"task_id": g.game.game_id, "task_type": g.game.task_type, "rewards": g.rewards, "cut": g.cut,
             "cut_step": g.cut_step, "env_steps": g.env_steps, "step_tokens": g.step_tokens,
             "generate_s": g.generate_s, "env_s": g.env_s, "cost_s": g.cost_s, "wall_s": g.wall_s}
            for g in groups
        ],
    }


# ---------------------------------------------------------------- Tier 1 A/B
@dataclass
class Tier1:
    baseline: Rollout
    gated: Rollout
    report: dict


def tier1_report(baseline: Rollout, gated: Rollout, gate: GateSpec, seed: int, resamples: int = 1000) -> dict:
    """Table 3 analogue. A cut is correct when the matched baseline group is zero-variance."""
    pairs = list(zip(baseline.groups, gated.groups))
    assert all(b.game.game_id == g.game.game_id for b, g in pairs)

    def arm(r: Rollout) -> dict:
        cost = [g.cost_s for g in r.groups]
        return {
            "wall_s": r.stats.wall_s, "task_cost_s_total": float(np.sum(cost)), "task_cost_s_mean": float(np.mean(cost)),
            "step_tokens_total": r.stats.step_tokens, "step_tokens_mean": r.stats.step_tokens / len(r.groups),
            "env_steps": r.stats.env_steps, "groups_cut": sum(g.cut for g in r.groups),
            "success_rate": float(np.mean([t.reward for t in r.trajectories])),
            # over trajectories (a group's G share a task: read it as a rough interval)
            "success_ci95": list(wilson(sum(t.won for t in r.trajectories), len(r.trajectories)) or (0.0, 0.0)),
            "groups_audited": sum(g.audited for g in r.groups),
        }

    base, gate_arm = arm(baseline), arm(gated)
    cut = [(b, g) for b, g in pairs if g.cut]
    correct = sum(b.zero_variance for b, _ in cut)
    base_cost = np.array([b.cost_s for b, _ in pairs])
    gated_cost = np.array([g.cost_s for _, g in pairs])

    def saving(b, g, axis=-1):
        return 1.0 - np.sum(g, axis=axis) / np.sum(b, axis=axis)

    ci = (float("nan"), float("nan"))
    if len(pairs) >= 2:
        res = sps.bootstrap((base_cost, gated_cost), saving, paired=True, vectorized=True, n_resamples=resamples,
                            confidence_level=0.95, method="percentile", rng=np.random.default_rng(seed))
        ci = (float(res.confidence_interval.low), float(res.confidence_interval.high))
    return {
        "gate": str(gate), "tasks": len(pairs), "seed": seed,
        "baseline": base, "gated": gate_arm,
        "change": {
            "wall_s": gate_arm["wall_s"] / base["wall_s"] - 1.0,
            "task_cost_s": gate_arm["task_cost_s_total"] / base["task_cost_s_total"] - 1.0,
            "step_tokens": gate_arm["step_tokens_total"] / max(1, base["step_tokens_total"]) - 1.0,
        },
        "groups_cut": len(cut),
        "cuts_correct": correct,
        "cut_precision": correct / len(cut) if cut else None,
        "baseline_zero_variance_groups": sum(b.zero_variance for b, _ in pairs),
        "identical_work": len(cut) == 0 and base["step_tokens_total"] == gate_arm["step_tokens_total"]
        and base["env_steps"] == gate_arm["env_steps"],
        "wall_saving": float(saving(base_cost, gated_cost)),
        "wall_saving_ci95": ci,
        "bootstrap": {"resamples": resamples, "unit": "task", "statistic": "1 - sum(gated task cost) / sum(baseline task cost)"},
    }


def tier1_markdown(rep: dict) -> str:
    b, g, c = rep["baseline"], rep["gated"], rep["change"]
    lo, hi = rep["wall_saving_ci95"]
    prec = "n/a (no cuts)" if rep["cut_precision"] is None else f"{100 * rep['cut_precision']:.1f}% ({rep['cuts_correct']}/{rep['groups_cut']})"
    return "\n".join([
        f"# Tier 1 A/B: gate {rep['gate']}, {rep['tasks']} tasks, seed {rep['seed']}",
        "",
        "| | baseline | gated | change |",
        "| --- | ---: | ---: | ---: |",
        f"| rollout wall-clock (s) | {b['wall_s']:.1f} | {g['wall_s']:.1f} | {100 * c['wall_s']:+.1f}% |",
        f"| task rollout time, total (s) | {b['task_cost_s_total']:.1f} | {g['task_cost_s_total']:.1f} | {100 * c['task_cost_s']:+.1f}% |",
        f"| task rollout time, mean per task (s) | {b['task_cost_s_mean']:.2f} | {g['task_cost_s_mean']:.2f} | |",
        f"| step-tokens, total | {b['step_tokens_total']} | {g['step_tokens_total']} | {100 * c['step_tokens']:+.1f}% |",
        f"| step-tokens, mean per task | {b['step_tokens_mean']:.0f} | {g['step_tokens_mean']:.0f} | |",
        f"| env steps | {b['env_steps']} | {g['env_steps']} | |",
        f"| success rate (95% Wilson, trajectories) | {_pct_ci(b)} | {_pct_ci(g)} | |",
        f"| groups cut | 0 | {rep['groups_cut']} | |",
        *([f"| groups audited (ran on, to measure the gate) | | {g['groups_audited']} | |"] if g.get("groups_audited") else []),
        "",
        f"Cut precision (cut group zero-variance in the baseline arm): {prec}. "
        f"Zero-variance groups in the baseline: {rep['baseline_zero_variance_groups']}/{rep['tasks']}.",
        f"Task-time saving {100 * rep['wall_saving']:.1f}%, 95% CI [{100 * lo:.1f}%, {100 * hi:.1f}%] "
        f"(percentile bootstrap, {rep['bootstrap']['resamples']} task resamples, seeded).",
        *([
            "",
            _auto_line(rep["auto"]),
        ] if rep.get("auto") else []),
        *([
            "",
            "Note: the gate cut nothing, so both arms did identical work (same tokens, same env steps); "
            "the time difference is run-to-run noise, which the task bootstrap does not capture.",
        ] if rep.get("identical_work") else []),
        "",
    ])


def _pct_ci(arm: dict) -> str:
    lo, hi = arm["success_ci95"]
    return f"{100 * arm['success_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _auto_line(a: dict) -> str:
    prec = ("n/a (nothing audited)" if a["precision_audit"] is None else
            f"{100 * a['precision_audit']:.0f}% of {a['audited']} audited groups, 95% CI "
            f"[{100 * a['precision_audit_ci95'][0]:.0f}%, {100 * a['precision_audit_ci95'][1]:.0f}%]")
    fit = "n/a" if a["precision_fit"] is None else f"{100 * a['precision_fit']:.0f}%"
    return (f"Auto gate: d_L at the end {a['d_L']:.3g} (fitted on {a['labelled']} labelled groups, fitted precision "
            f"{fit}); live precision: {prec}.")


def run_tier1(cfg: Config, games, generator: Generator, gate: GateSpec, progress=None) -> Tier1:
    """Both arms with the same seeds; the warm-up call keeps one-off start-up cost out of both."""
    sampler = generator.sampler
    sampler.generate([GenRequest(sampler.tokenizer("warm up", add_special_tokens=False).input_ids)], SamplingParams(0.0, 1.0, 2))
    baseline = roll_rounds(cfg, games, generator, None, progress, "baseline")
    stage = make_cut_stage(cfg, gate)
    gated = roll_rounds(cfg, games, generator, stage, progress, "gated")
    report = tier1_report(baseline, gated, gate, cfg.seed)
    if (learned := stage.rule.report()) is not None:  # the auto gate: the d_L it ended with, its labels, its audit
        report["auto"] = learned
    return Tier1(baseline, gated, report)


def load_games(cfg: Config):
    """`agentrl rollout`'s B games: the split's first `skip_tasks + tasks` (task types interleaved), less the skipped."""
    skip = cfg.rollout.skip_tasks
    games = find_games(cfg.env.kind, cfg.rollout.split, cfg.data.root, limit=skip + cfg.rollout.tasks)[skip:]
    if not games:
        raise UserError(f"no games left in {cfg.rollout.split} after skipping the first {skip}")
    return games
