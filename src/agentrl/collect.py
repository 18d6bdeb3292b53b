"""`agentrl rollout`: B tasks x G trajectories with the gate; trajectories.jsonl + groups.csv.

`--tier1-ab` (the paper's Tier 1): the same tasks twice with the same seeds, baseline (no
gate) and gated, and the Table 3 analogue comparing the two arms. `--tier1-baseline DIR` rolls
only the gated arm and pairs it with an earlier ungated rollout of the same tasks and seed (e.g. a
chunk of `benchmarks/bench_gate_signals.sh`), so a signal table's rollouts are not paid twice.
Both read the same per-group records (`rollout_summary`), so one report serves both.
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
from agentrl.machine import machine
from agentrl.rollout import SIGNALS, Rollout, merge_rollouts
from agentrl.rollout.generator import Generator
from agentrl.rollout.plan import check_kv_fits
from agentrl.sampling.base import GenRequest, SamplingParams
from agentrl.select.auto_gate import read_warmup_rows
from agentrl.select.cut import CutStage
from agentrl.specs import GateSpec
from agentrl.stats import wilson

GROUP_COLUMNS = ["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated", "step_tokens"]


def prepare_rollout(cfg: Config) -> tuple[list, Generator]:
    """(games, generator): everything that can fail on bad input, before any episode runs."""
    games = load_games(cfg)
    gate = cfg.rollout.parsed_gate()
    if gate is not None and gate.auto and cfg.gate.warmup:  # a bad table refused before the memory plan (read
        read_warmup_rows(Path(cfg.gate.warmup), gate.K, ())  # again, and fitted, when the stage is built)
    check_kv_fits(cfg, round_size(cfg, len(games)) * cfg.rollout.group_size, cfg.t_max("rollout"), "rollout")
    return games, Generator(cfg)


def run_rollout(cfg: Config, games, generator: Generator, out: Path, tier1_ab: bool = False, progress=None,
                tier1_baseline: Path | None = None):
    """`agentrl rollout`: the gated rollout (or, with `tier1_ab`, the Tier 1 A/B; with
    `tier1_baseline`, the gated arm paired with that earlier ungated rollout: `tier1_against`)
    written into `out`; returns the Rollout (or the Tier1). The generator is closed when done."""
    gate = cfg.rollout.parsed_gate()
    with generator:
        if not tier1_ab:
            stage = make_cut_stage(cfg, gate)
            rollout = roll_rounds(cfg, games, generator, stage, progress)
            summary = write_rollout(rollout, out, cfg.rollout.signal_steps, stage.rule.report() if stage is not None else None,
                                    machine(cfg))
            if tier1_baseline is None:
                return rollout
            result = Tier1(None, rollout, tier1_against(tier1_baseline, summary, out, gate, cfg.seed))
            atomic_write_json(out / "tier1.json", result.report)
            atomic_write_text(out / "tier1.md", tier1_markdown(result.report))
            return result
        result = run_tier1(cfg, games, generator, gate, progress)
    for name, r in (("baseline", result.baseline), ("gated", result.gated)):
        write_rollout(r, out / name, cfg.rollout.signal_steps, machine_record=machine(cfg))
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


def write_rollout(rollout: Rollout, out: Path, signal_steps, gate_report: dict | None = None,
                  machine_record: dict | None = None) -> dict:
    """trajectories.jsonl, groups.csv and summary.json (`gate_report`: what an auto gate learned;
    `machine_record`: what it ran on, machine.py); returns the summary written."""
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
    summary = rollout_summary(rollout) | ({"gate": gate_report} if gate_report else {}) | (
        {"machine": machine_record} if machine_record else {})
    atomic_write_json(out / "summary.json", summary)
    return summary


def rollout_summary(rollout: Rollout) -> dict:
    s, groups = rollout.stats, rollout.groups
    return {
        "groups": len(groups),
        "trajectories": len(rollout.trajectories),
        "groups_cut": sum(g.cut for g in groups),
        "zero_variance_groups": sum(g.zero_variance for g in groups),
        "success_rate": float(np.mean([t.reward for t in rollout.trajectories])),
        "won": sum(t.won for t in rollout.trajectories),
        "wall_s": s.wall_s, "generate_s": s.generate_s, "env_s": s.env_s,
        "env_steps": s.env_steps, "step_tokens": s.step_tokens,
        "per_group": [
            {"task_id": g.game.game_id, "task_type": g.game.task_type, "rewards": g.rewards, "cut": g.cut,
             "audited": g.audited, "cut_step": g.cut_step, "env_steps": g.env_steps, "step_tokens": g.step_tokens,
             "generate_s": g.generate_s, "env_s": g.env_s, "cost_s": g.cost_s, "wall_s": g.wall_s}
            for g in groups
        ],
    }


# ---------------------------------------------------------------- Tier 1 A/B
@dataclass
class Tier1:
    baseline: Rollout | None  # None: paired with an earlier rollout's directory (--tier1-baseline)
    gated: Rollout
    report: dict


def tier1_report(baseline: dict, gated: dict, gate: GateSpec | str, seed: int, resamples: int = 1000,
                 oracle_tokens: int | None = None) -> dict:
    """Table 3 analogue of two `rollout_summary` records of the same tasks in the same order. A cut
    is correct when the matched baseline group is zero-variance (all G rewards equal). The oracle
    cuts exactly those groups at K: it saves their step-tokens after K (`oracle_tokens`, from the
    baseline's rows: `oracle_saved_tokens`), which bounds what any gate at K can save."""
    pairs = list(zip(baseline["per_group"], gated["per_group"]))
    assert len(baseline["per_group"]) == len(gated["per_group"]) and all(b["task_id"] == g["task_id"] for b, g in pairs)

    def arm(r: dict) -> dict:
        cost = [g["cost_s"] for g in r["per_group"]]
        return {
            "wall_s": r["wall_s"], "task_cost_s_total": float(np.sum(cost)), "task_cost_s_mean": float(np.mean(cost)),
            "step_tokens_total": r["step_tokens"], "step_tokens_mean": r["step_tokens"] / len(cost),
            "env_steps": r["env_steps"], "groups_cut": sum(g["cut"] for g in r["per_group"]),
            "success_rate": r["success_rate"],
            # over trajectories (a group's G share a task: read it as a rough interval)
            "success_ci95": list(wilson(r["won"], r["trajectories"]) or (0.0, 0.0)),
            "groups_audited": sum(g.get("audited", False) for g in r["per_group"]),
        }

    def zero(g: dict) -> bool:
        return len(set(g["rewards"])) <= 1

    base, gate_arm = arm(baseline), arm(gated)
    cut = [(b, g) for b, g in pairs if g["cut"]]
    correct = sum(zero(b) for b, _ in cut)
    base_cost = np.array([b["cost_s"] for b, _ in pairs])
    gated_cost = np.array([g["cost_s"] for _, g in pairs])
    base_tokens = np.array([b["step_tokens"] for b, _ in pairs], dtype=float)
    gated_tokens = np.array([g["step_tokens"] for _, g in pairs], dtype=float)

    def saving(b, g, axis=-1):
        return 1.0 - np.sum(g, axis=axis) / np.sum(b, axis=axis)

    def interval(b, g) -> tuple[float, float]:
        if len(pairs) < 2 or not np.sum(b):
            return float("nan"), float("nan")
        res = sps.bootstrap((b, g), saving, paired=True, vectorized=True, n_resamples=resamples,
                            confidence_level=0.95, method="percentile", rng=np.random.default_rng(seed))
        return float(res.confidence_interval.low), float(res.confidence_interval.high)

    informative_cut = [b for b, _ in cut if not zero(b)]
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
        "cut_precision_ci95": list(wilson(correct, len(cut))) if cut else None,
        "informative_groups_cut": len(informative_cut),
        "baseline_zero_variance_groups": sum(zero(b) for b, _ in pairs),
        "identical_work": len(cut) == 0 and base["step_tokens_total"] == gate_arm["step_tokens_total"]
        and base["env_steps"] == gate_arm["env_steps"],
        "wall_saving": float(saving(base_cost, gated_cost)),
        "wall_saving_ci95": interval(base_cost, gated_cost),
        "step_token_saving": float(saving(base_tokens, gated_tokens)),
        "step_token_saving_ci95": interval(base_tokens, gated_tokens),
        "oracle_step_token_saving": oracle_tokens / max(1, base["step_tokens_total"]) if oracle_tokens is not None else None,
        "bootstrap": {"resamples": resamples, "unit": "task", "statistic": "1 - sum(gated task cost) / sum(baseline task cost)"},
    }


def tier1_against(baseline_dir: Path, gated: dict, gated_dir: Path, gate: GateSpec, seed: int) -> dict:
    """The Tier 1 report of a gated rollout (`gated`: its summary; `gated_dir`: where it was written)
    against an earlier ungated rollout in `baseline_dir` of the same tasks, in the same order, and
    the same seed. The tasks and G are checked (one line refuses a mismatch); the seed is not
    recorded, so the report says how many rows took the same actions as their baseline row over
    the steps both ran (all of them, under the same seed, weights and numerics)."""
    base = read_rollout_summary(baseline_dir)
    if base["groups_cut"]:
        raise UserError(f"--tier1-baseline {baseline_dir}: {base['groups_cut']} of its groups were cut; the baseline must be ungated (--gate off)")
    ids_b, ids_g = [g["task_id"] for g in base["per_group"]], [g["task_id"] for g in gated["per_group"]]
    if ids_b != ids_g:
        raise UserError(f"--tier1-baseline {baseline_dir}: not the same tasks in the same order ({len(ids_b)} groups there, "
                        f"{len(ids_g)} here; first difference at group {next((i for i, (a, b) in enumerate(zip(ids_b, ids_g)) if a != b), min(len(ids_b), len(ids_g)))}); "
                        "give the same --split, --skip-tasks and --tasks")
    if base["trajectories"] != gated["trajectories"]:
        raise UserError(f"--tier1-baseline {baseline_dir}: G differs ({base['trajectories']} trajectories there, {gated['trajectories']} here)")
    rows = list(_records(baseline_dir))  # read once: wins, the pairing check and the oracle
    if "won" not in base:  # written before summaries counted wins: from its trajectories
        base["won"] = sum(r["won"] for r in rows)
    same = sum(b["actions"][:len(g["actions"])] == g["actions"][:len(b["actions"])]
               for b, g in zip(rows, _records(gated_dir)))
    report = tier1_report(base, gated, gate, seed, oracle_tokens=oracle_saved_tokens(rows, gate.K))
    if gated.get("gate"):
        report["auto"] = gated["gate"]
    return report | {"baseline_dir": str(baseline_dir), "rows_matching_baseline": [int(same), gated["trajectories"]]}


def oracle_saved_tokens(rows, K: int) -> int:
    """Step-tokens after step K of the zero-variance groups (the oracle's cut): `rows` are trajectory
    records (task_id, reward, step_tokens), a group being the rows of one task."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["task_id"], []).append(r)
    return sum(sum(n for r in g for n in r["step_tokens"][K:]) for g in groups.values()
               if len({r["reward"] for r in g}) <= 1)


def read_rollout_summary(path: Path) -> dict:
    """An `agentrl rollout` directory's summary.json (one line refuses anything else)."""
    f = path / "summary.json"
    try:
        s = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {f}: {e.__class__.__name__} (give an `agentrl rollout` output directory)") from None
    if not isinstance(s, dict) or "per_group" not in s:
        raise UserError(f"{f} is not an `agentrl rollout` summary (no per_group records)")
    return s


def _records(path: Path):
    with (path / "trajectories.jsonl").open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


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
        *([_token_line(rep)] if "step_token_saving" in rep else []),
        *([f"Paired with the ungated rollout in {rep['baseline_dir']}: {rep['rows_matching_baseline'][0]} of "
           f"{rep['rows_matching_baseline'][1]} rows took the same actions as their baseline row over the steps both ran."]
          if rep.get("baseline_dir") else []),
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


def _token_line(rep: dict) -> str:
    lo, hi = rep["step_token_saving_ci95"]
    oracle = rep.get("oracle_step_token_saving")
    return (f"Step-token saving {100 * rep['step_token_saving']:.1f}%, 95% CI [{100 * lo:.1f}%, {100 * hi:.1f}%]"
            + (f"; the oracle (every zero-variance group cut at K) saves {100 * oracle:.1f}%, so the gate took "
               f"{100 * rep['step_token_saving'] / oracle:.0f}% of it" if oracle else "")
            + f". Informative groups cut: {rep.get('informative_groups_cut', 0)}"
            + (f"; cut precision 95% Wilson [{100 * rep['cut_precision_ci95'][0]:.0f}%, {100 * rep['cut_precision_ci95'][1]:.0f}%]."
               if rep.get("cut_precision_ci95") else "."))


def _pct_ci(arm: dict) -> str:
    lo, hi = arm["success_ci95"]
    return f"{100 * arm['success_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _auto_line(a: dict) -> str:
    prec = ("n/a (nothing audited)" if a["precision_audit"] is None else
            f"{100 * a['precision_audit']:.0f}% of {a['audited']} audited groups, 95% CI "
            f"[{100 * a['precision_audit_ci95'][0]:.0f}%, {100 * a['precision_audit_ci95'][1]:.0f}%]")
    fit = "n/a" if a["precision_fit"] is None else f"{100 * a['precision_fit']:.0f}%"
    if "p_cut" in a:  # a classifier gate (K,auto:S1+S2+...)
        cut = "nothing cut" if a["p_cut"] is None else f"cut where P(zero variance) > {a['p_cut']:.3g}"
        cut += ", sparing every group with a row ended by K" if a.get("guard") else ""
        return (f"Classifier gate on {len(a['signals'])} signals: at the end {cut} (fitted on {a['labelled']} labelled "
                f"groups, cross-fitted precision {fit}); live precision: {prec}.")
    return (f"Auto gate: d_L at the end {a['d_L']:.3g} (fitted on {a['labelled']} labelled groups, fitted precision "
            f"{fit}); live precision: {prec}.")


def run_tier1(cfg: Config, games, generator: Generator, gate: GateSpec, progress=None) -> Tier1:
    """Both arms with the same seeds; the warm-up call keeps one-off start-up cost out of both."""
    sampler = generator.sampler
    sampler.generate([GenRequest(sampler.tokenizer("warm up", add_special_tokens=False).input_ids)], SamplingParams(0.0, 1.0, 2))
    baseline = roll_rounds(cfg, games, generator, None, progress, "baseline")
    stage = make_cut_stage(cfg, gate)
    gated = roll_rounds(cfg, games, generator, stage, progress, "gated")
    oracle = oracle_saved_tokens(({"task_id": g.game.game_id, "reward": t.reward, "step_tokens": t.step_tokens}
                                  for g in baseline.groups for t in g.trajectories), gate.K)
    report = tier1_report(rollout_summary(baseline), rollout_summary(gated), gate, cfg.seed, oracle_tokens=oracle)
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
