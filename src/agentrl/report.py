"""`agentrl report`: tables and figures from one or more training run directories.

A run directory (written by `agentrl train`) holds `config.yaml` (the resolved config tree) and
`metrics.jsonl` (one "iteration" line per GRPO update, one "eval" line per held-out evaluation).
The report gives, per run, iterations done, held-out success, wall-clock and time per iteration,
training reward, groups cut and zero-variance groups, step-tokens; per baseline/gated pair (same
seed, gate off vs a gate) the analogue of the paper's Table 5, pooled over the seeds where one
gate setup has several (seed_pools); and the paper's figures (held-out
success, cumulative wall-clock, training reward, cut vs zero-variance counts (Fig. 4), zero-advantage
fraction and gradient L2 norm (Fig. 7)) with one line per run.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from agentrl.errors import UserError
from agentrl.io import atomic_path, atomic_write_json, atomic_write_text, read_jsonl
from agentrl.stats import bootstrap_saved, eval_text, learning_verdict, paired, rank_correlation, seed_interval, warm_start_verdict

log = logging.getLogger(__name__)

PHASES = ("rollout", "train", "swap", "eval", "iteration")  # <phase>_s keys of an iteration line


# ---------------------------------------------------------------- reading a run
@dataclass
class Run:
    path: Path
    config: dict
    iterations: list[dict]  # "iteration" lines, one per iteration number (the last one logged wins), sorted
    evals: list[dict]  # "eval" lines of the held-out split, one per iteration number, sorted
    heldout_split: str | None
    warnings: list[str] = field(default_factory=list)
    base_eval: dict | None = None  # the base model's eval on the same games (train.eval_base), before the warm start

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def gate(self) -> str:
        return normalise_gate(config_value(self.config, "rollout.gate"))

    @property
    def seed(self) -> int | None:
        return config_value(self.config, "seed")

    def series(self, key: str, rows: list[dict] | None = None) -> tuple[list[int], list[float]]:
        """(iteration, value) of rows carrying a finite number under key (a gap elsewhere)."""
        rows = self.iterations if rows is None else rows
        xs, ys = [], []
        for r in rows:
            if is_number(r.get(key)):
                xs.append(r["iteration"])
                ys.append(float(r[key]))
        return xs, ys


def config_value(config: dict, dotted: str, default=None):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def normalise_gate(gate) -> str:
    """The gate as written on the command line: "off" or "K,d_L" (YAML 1.1 reads a bare off as False)."""
    if gate is None or gate is False or str(gate).strip().lower() in ("off", "none", "false", ""):
        return "off"
    return str(gate).replace(" ", "")


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path: Path, warnings: list[str]) -> list[dict]:
    """JSON objects of metrics.jsonl; an unparsable line (a torn last line) is skipped with a warning."""
    def skipped(message: str) -> None:
        warnings.append(message)
        log.warning(message)

    return [row for row in read_jsonl(path, on_skip=skipped) if isinstance(row, dict)]


def read_config(path: Path, warnings: list[str]) -> dict:
    if not path.is_file():
        warnings.append(f"{path} not found: gate, seed and model unknown")
        log.warning(warnings[-1])
        return {}
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        warnings.append(f"{path} is not valid YAML ({str(e).splitlines()[0]}): gate, seed and model unknown")
        log.warning(warnings[-1])
        return {}
    return config if isinstance(config, dict) else {}


def last_per_iteration(rows: list[dict]) -> list[dict]:
    by_iteration = {r["iteration"]: r for r in rows if isinstance(r.get("iteration"), int)}
    return [by_iteration[i] for i in sorted(by_iteration)]


def load_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"run directory not found: {path}")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path} has no metrics.jsonl: not a training run directory (agentrl train writes one)")
    warnings: list[str] = []
    config = read_config(path / "config.yaml", warnings)
    rows = read_metrics(metrics, warnings)
    iterations = last_per_iteration([r for r in rows if r.get("kind") == "iteration"])
    if not iterations:
        raise UserError(f"{metrics} has no iteration lines: the run has not finished an iteration yet")
    evals = [r for r in rows if r.get("kind") == "eval"]
    split = config_value(config, "train.eval_split")
    splits = [r.get("split") for r in evals]
    if split not in splits and splits:
        split = max(set(splits), key=splits.count)  # the config's split is unknown: the most evaluated one
    base = [r for r in rows if r.get("kind") == "base_eval" and r.get("split") == split]
    evals = last_per_iteration([r for r in evals if r.get("split") == split])
    return Run(path, config, iterations, evals, split if evals else None, warnings, base[-1] if base else None)


# ---------------------------------------------------------------- numbers
def mean(values) -> float | None:
    values = [float(v) for v in values if is_number(v)]
    return sum(values) / len(values) if values else None


def total(run: Run, key: str) -> int | float:
    """The sum of key over the run's iterations."""
    return sum(r[key] for r in run.iterations if is_number(r.get(key)))


def run_summary(run: Run) -> dict:
    """The per-run table's numbers."""
    last = run.iterations[-1]
    final = run.evals[-1] if run.evals else None
    scored = [r for r in run.evals if is_number(r.get("success"))]
    best = max(scored, key=lambda r: (r["success"], -r["iteration"])) if scored else None  # the earliest of ties
    return {
        "run": str(run.path), "name": run.name, "gate": run.gate, "seed": run.seed,
        "model": config_value(run.config, "model.name"),
        "tasks": config_value(run.config, "rollout.tasks"), "group_size": config_value(run.config, "rollout.group_size"),
        "iterations_planned": config_value(run.config, "train.iterations"),
        "iterations": last["iteration"],
        "heldout_split": run.heldout_split,
        "initial_heldout_success": run.evals[0].get("success") if run.evals and run.evals[0]["iteration"] == 0 else None,
        "initial_heldout": eval_text(run.evals[0]) if run.evals and is_number(run.evals[0].get("success")) else None,
        "final_heldout_success": final.get("success") if final else None,
        "final_heldout": eval_text(final) if final and is_number(final.get("success")) else None,
        "final_heldout_iteration": final["iteration"] if final else None,
        "best_heldout_success": best.get("success") if best else None,
        "best_heldout_iteration": best["iteration"] if best else None,
        # first vs last eval on the same games (exact McNemar): did the run move beyond noise?
        "heldout_verdict": learning_verdict(scored),
        # the learning curve from the base model: base, then each eval (iteration 0: the warm start)
        "curve": curve(run),
        "warm_start_verdict": warm_start_verdict(run.base_eval, scored),
        "wall_clock_s": last.get("elapsed_s"),
        "mean_s_per_iteration": {p: mean(r.get(f"{p}_s") for r in run.iterations) for p in PHASES},
        "mean_train_reward": mean(r.get("train_reward") for r in run.iterations),  # uncut groups: rises as a gate cuts failures
        "mean_train_success": mean(r.get("train_success") for r in run.iterations),  # every trajectory (runs before it: None)
        "groups": total(run, "groups"),
        "groups_cut": total(run, "groups_cut"),
        "zero_variance_groups": total(run, "zero_variance_groups"),
        "zero_variance_all_fail": total(run, "zero_variance_all_fail"),
        "zero_variance_all_success": total(run, "zero_variance_all_success"),
        "step_tokens_generated": total(run, "step_tokens_generated"),
        "step_tokens_trained": total(run, "step_tokens_trained"),
        "skipped_updates": sum(bool(r.get("skipped_update")) for r in run.iterations),
        # the KL penalty as configured and in the field's unit (per action token), and the success replay
        "kl_coef": config_value(run.config, "learner.kl_coef"), "kl_unit": config_value(run.config, "learner.kl_unit", "trained-mean"),
        "kl_coef_field_mean": mean(r.get("kl_coef_field") for r in run.iterations),
        "kl_mean": mean(r.get("kl_to_warm_start") for r in run.iterations),
        "replay_nll_mean": mean(r.get("replay_nll") for r in run.iterations),
        "replay_buffer": run.iterations[-1].get("replay_buffer"),
        "warnings": run.warnings,
    }


def curve(run: Run) -> list[dict]:
    """Held-out success from the base model on: (what, success with its interval, the paired
    difference to the point before, its exact McNemar p) per point."""
    init = config_value(run.config, "train.init_adapter")
    points = [("base model", run.base_eval)] if run.base_eval else []
    points += [(f"iteration {r['iteration']}" + (" (warm start)" if r["iteration"] == 0 and init else ""), r)
               for r in run.evals if is_number(r.get("success"))]
    out, before = [], None
    for name, r in points:
        step = paired(before["outcomes"], r["outcomes"]) if before and "outcomes" in before and "outcomes" in r else None
        out.append({"what": name, "heldout": eval_text(r), "success": r["success"],
                    "change_pts": step["difference_points"] if step else None, "p": step["mcnemar_p"] if step else None})
        before = r
    return out


def find_pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    """(baseline, gated) pairs: same seed, gate off vs a gate; among several baselines, the same setup first."""
    setup = ("model.name", "rollout.tasks", "rollout.group_size", "train.iterations")

    def mismatches(a: Run, b: Run) -> int:
        return sum(config_value(a.config, k) != config_value(b.config, k) for k in setup)

    pairs = []
    for gated in runs:
        if gated.gate == "off" or gated.seed is None:
            continue
        baselines = [b for b in runs if b.gate == "off" and b.seed == gated.seed]
        if baselines:
            pairs.append((min(baselines, key=lambda b: mismatches(b, gated)), gated))
    return pairs


GRAD_NORMS = {"grad_l2_norm_mean": "mean over the update's steps", "grad_l2_norm": "the update's first step"}


def grad_norm_key(runs: list[Run]) -> str:
    """The gradient norm the report reads: the mean over every optimizer step of an update where
    each run recorded it on every iteration (raft's 16 steps: the first one is a sixteenth of the
    update), else the first step's, which every run has (runs written before the mean)."""
    def has_mean(run: Run) -> bool:
        return all(is_number(r.get("grad_l2_norm_mean")) for r in run.iterations if is_number(r.get("grad_l2_norm")))

    return "grad_l2_norm_mean" if runs and all(map(has_mean, runs)) else "grad_l2_norm"


def pair_summary(baseline: Run, gated: Run) -> dict:
    """The paper's Table 5 analogue: what the gate changed against the same-seed baseline."""
    b, g = run_summary(baseline), run_summary(gated)
    norm_key = grad_norm_key([baseline, gated])
    b_norm, g_norm = (dict(zip(*r.series(norm_key))) for r in (baseline, gated))
    common = sorted(b_norm.keys() & g_norm.keys())
    b_mean, g_mean = mean(b_norm[i] for i in common), mean(g_norm[i] for i in common)
    wall_b, wall_g = b["wall_clock_s"], g["wall_clock_s"]
    # held-out success at the last iteration both arms evaluated: arms stopped at different
    # iterations are compared where both stood, never one arm's iteration 16 against the other's 9
    last_b, last_g = last_common_evals(baseline, gated)
    # the Tier 3 measure: rollout step-tokens (and rollout seconds) the gated arm spent against the
    # baseline's, over the iterations both ran (the same tasks; each arm's own policy samples them)
    both = {r["iteration"] for r in baseline.iterations} & {r["iteration"] for r in gated.iterations}
    tokens_b, tokens_g = map(sum, per_iteration(baseline, gated, "step_tokens_generated"))
    rollout_b, rollout_g = map(sum, per_iteration(baseline, gated, "rollout_s"))
    return {
        "seed": gated.seed, "baseline": b["run"], "gated": g["run"], "gate": gated.gate,
        # drop (the paper's: the kept rows' step grows by sampled / kept) or zero (cut groups in N at A = 0)
        "cut_groups": config_value(gated.config, "advantage.cut_groups") or "drop",
        "iterations_baseline": b["iterations"], "iterations_gated": g["iterations"],
        "wall_clock_change_pct": 100 * (wall_g / wall_b - 1) if is_number(wall_b) and is_number(wall_g) and wall_b > 0 else None,
        "groups_cut": g["groups_cut"],
        "grad_norm_ratio": g_mean / b_mean if b_mean and g_mean is not None else None,
        "grad_norm_iterations": len(common),
        "grad_norm": GRAD_NORMS[norm_key],  # which norm the ratio is of
        "heldout_iteration": last_b["iteration"] if last_b else None,
        "heldout_delta_pts": (100 * (last_g["success"] - last_b["success"])
                              if last_b and is_number(last_b.get("success")) and is_number(last_g.get("success")) else None),
        "heldout_paired": eval_pair(last_b, last_g),
        "iterations_compared": len(both),
        "step_tokens_baseline": tokens_b, "step_tokens_gated": tokens_g,
        "step_tokens_saved_pct": 100 * (1 - tokens_g / tokens_b) if tokens_b else None,
        "rollout_s_baseline": rollout_b, "rollout_s_gated": rollout_g,
        "rollout_s_change_pct": 100 * (rollout_g / rollout_b - 1) if rollout_b else None,
        "train_success_baseline": b["mean_train_success"], "train_success_gated": g["mean_train_success"],
        "zero_variance_groups_baseline": b["zero_variance_groups"],
        "zero_variance_groups_gated": g["zero_variance_groups"],
    }


def per_iteration(baseline: Run, gated: Run, key, key_gated=None) -> tuple[list[float], list[float]]:
    """key's values (the gated arm's: key_gated's, default the same; a key or a function of an
    iteration line) of the iterations both arms ran and recorded them, aligned (the same tasks in both)."""
    def value(k):
        return k if callable(k) else lambda r: r.get(k)

    value_b, value_g = value(key), value(key_gated or key)
    at_b = {r["iteration"]: value_b(r) for r in baseline.iterations}
    at_g = {r["iteration"]: value_g(r) for r in gated.iterations}
    both = [i for i in sorted(at_b.keys() & at_g.keys()) if is_number(at_b[i]) and is_number(at_g[i])]
    return [at_b[i] for i in both], [at_g[i] for i in both]


def cut_share(row: dict) -> float | None:
    """The share of an iteration's groups the gate cut."""
    cut, groups = row.get("groups_cut"), row.get("groups")
    return cut / groups if is_number(cut) and is_number(groups) and groups else None


def seed_pools(pairs: list[tuple[Run, Run]], summaries: list[dict]) -> list[dict]:
    """Table 5 over seeds: the pairs of one gate setup (gate, cut groups) at two or more seeds,
    pooled. Rollout step-tokens saved over every iteration both arms of a pair ran, with a
    bootstrap over those iterations (an iteration's tasks are the same in both arms: the paired
    unit); the held-out difference's mean over the seeds with a t interval over them, where every
    pair has one at the same iteration; and the gated arm's share of groups cut against the
    ungated arm's train success, iteration by iteration (Spearman's rho). One pair per seed: a
    setup with a seed twice is left out."""
    by_setup = defaultdict(list)
    for (b, g), p in zip(pairs, summaries):
        by_setup[(p["gate"], p["cut_groups"])].append((b, g, p))
    pools = []
    for (gate, cut_groups), items in by_setup.items():
        seeds = [p["seed"] for *_, p in items]
        if len(seeds) < 2 or len(set(seeds)) < len(seeds):
            continue
        tokens_b, tokens_g, rollout_b, rollout_g, success_b, cut_g = [], [], [], [], [], []
        for b, g, _ in items:
            for keys, into_b, into_g in ((("step_tokens_generated",), tokens_b, tokens_g), (("rollout_s",), rollout_b, rollout_g),
                                         (("train_success", cut_share), success_b, cut_g)):
                values_b, values_g = per_iteration(b, g, *keys)
                into_b += values_b
                into_g += values_g
        deltas = [p["heldout_delta_pts"] for *_, p in items]
        at = {p["heldout_iteration"] for *_, p in items}
        held = seed_interval(deltas) if all(is_number(d) for d in deltas) and len(at) == 1 else None
        pools.append({
            "gate": gate, "cut_groups": cut_groups, "seeds": sorted(seeds), "iterations_compared": len(tokens_b),
            "step_tokens_baseline": sum(tokens_b), "step_tokens_gated": sum(tokens_g),
            "step_tokens_saved_pct": 100 * (1 - sum(tokens_g) / sum(tokens_b)) if sum(tokens_b) else None,
            "step_tokens_saved_ci95": [100 * x for x in bootstrap_saved(tokens_b, tokens_g)] if sum(tokens_b) else None,
            "rollout_s_change_pct": 100 * (sum(rollout_g) / sum(rollout_b) - 1) if sum(rollout_b) else None,
            "heldout_iteration": at.pop() if held else None, "heldout_delta_over_seeds": held,
            # issue 49: how the share of groups cut moves as the policy's success rises. The ungated
            # arm's train success: the same tasks, and a cut row cannot win later, so the gated
            # arm's own success reads low where the gate cut
            "cut_share_vs_train_success": rank_correlation(success_b, cut_g),
        })
    return pools


def last_common_evals(baseline: Run, gated: Run) -> tuple[dict | None, dict | None]:
    """The two arms' held-out evals at the last iteration both evaluated; (None, None) if none."""
    at_b, at_g = ({e["iteration"]: e for e in r.evals} for r in (baseline, gated))
    both = at_b.keys() & at_g.keys()
    return (at_b[max(both)], at_g[max(both)]) if both else (None, None)


def eval_pair(b: dict | None, g: dict | None) -> dict | None:
    """Two held-out evals paired on the same games (exact McNemar), where both ran the same split
    at the same iteration with per-game outcomes; None otherwise."""
    if not b or not g:
        return None
    if b["iteration"] != g["iteration"] or b.get("split") != g.get("split") or "outcomes" not in b or "outcomes" not in g:
        return None
    r = paired(b["outcomes"], g["outcomes"])
    return {"iteration": b["iteration"], "split": b.get("split"), "games": r["games"],
            "difference_points": r["difference_points"], "mcnemar_p": r["mcnemar_p"],
            "won_only_by_gated": len(r["won_only_by_b"]), "won_only_by_baseline": len(r["won_only_by_a"])}


# ---------------------------------------------------------------- figures
def label(run: Run) -> str:
    return f"{run.name} (gate {run.gate})"


def save_figure(fig, path: Path) -> Path:
    """savefig to a temporary file beside path, then rename: a reader never sees half a PNG."""
    with atomic_path(path, directory=False, suffix=".png") as tmp:  # the suffix: savefig reads the format from it
        fig.savefig(tmp, dpi=120)
    return path


def style(ax, ylabel: str, title: str, legend_size: int | None = 8) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend_size:
        ax.legend(fontsize=legend_size)


def line_figure(runs: list[Run], out: Path, name: str, key: str, ylabel: str, title: str, evals: bool = False,
                ylim: tuple[float, float] | None = None) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in runs:
        xs, ys = run.series(key, run.evals if evals else None)
        (line,) = ax.plot(xs, ys, marker="o" if evals or len(xs) < 30 else None, ms=3, label=label(run))
        if evals and run.base_eval and is_number(run.base_eval.get(key)):  # where the curve started: the base model
            ax.axhline(run.base_eval[key], ls=":", color=line.get_color(), label=f"{run.name}: base model")
    style(ax, ylabel, title)
    if ylim:
        ax.set_ylim(*ylim)
    fig.tight_layout()
    path = save_figure(fig, out / name)
    plt.close(fig)
    return path


def cut_vs_zero_variance_figure(runs: list[Run], out: Path) -> Path:
    """Paper Fig. 4: groups cut by the gate vs zero-variance groups (among uncut), per iteration."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*run.series("groups_cut"), color=color, ls="-", marker="o", ms=3, label=f"{label(run)}: cut")
        ax.plot(*run.series("zero_variance_groups"), color=color, ls="--", marker="x", ms=3,
                label=f"{label(run)}: zero-variance")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    style(ax, "groups", "groups cut (solid) vs zero-variance groups (dashed)", legend_size=7)
    fig.tight_layout()
    path = save_figure(fig, out / "cut_vs_zero_variance.png")
    plt.close(fig)
    return path


def zero_adv_grad_norm_figure(runs: list[Run], out: Path) -> Path:
    """Paper Fig. 7: zero-advantage fraction of the batch (left) and gradient L2 norm (right)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    norm_key = grad_norm_key(runs)  # one norm for every line: mean and first step do not mix
    for run in runs:
        left.plot(*run.series("zero_adv_fraction"), marker="o", ms=3, label=label(run))
        right.plot(*run.series(norm_key), marker="o", ms=3, label=label(run))
    style(left, "share of trajectories with advantage 0", "zero-advantage fraction")
    style(right, "gradient L2 norm (before clipping)", f"gradient norm: {GRAD_NORMS[norm_key]}", legend_size=None)
    fig.tight_layout()
    path = save_figure(fig, out / "zero_adv_grad_norm.png")
    plt.close(fig)
    return path


def figures(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [
        line_figure(runs, out, "heldout_success.png", "success", "held-out success", "held-out success", evals=True,
                    ylim=(-0.02, 1.02)),
        line_figure(runs, out, "wall_clock.png", "elapsed_s", "cumulative wall-clock (s)", "wall-clock"),
        line_figure(runs, out, "train_reward.png", "train_reward", "mean reward (uncut groups)", "training reward"),
        cut_vs_zero_variance_figure(runs, out),
        zero_adv_grad_norm_figure(runs, out),
    ]


# ---------------------------------------------------------------- the report
def default_out(runs: list[Path]) -> Path:
    return Path(runs[0]) / "report" if len(runs) == 1 else Path("runs/report")


def build_report(runs: list[Path], out: Path | None = None) -> dict:
    """Read the runs, write report.md, report.json and the figures into out; return the report."""
    if not runs:
        raise UserError("give at least one run directory")
    loaded = [load_run(Path(p)) for p in runs]
    out = Path(out) if out is not None else default_out(runs)
    out.mkdir(parents=True, exist_ok=True)
    pairs = find_pairs(loaded)
    rep = {
        "runs": [run_summary(r) for r in loaded],
        "pairs": [pair_summary(b, g) for b, g in pairs],
        "figures": [str(p) for p in figures(loaded, out)],
    }
    rep["seed_pools"] = seed_pools(pairs, rep["pairs"])
    atomic_write_text(out / "report.md", report_markdown(rep))
    atomic_write_json(out / "report.json", rep)
    return rep


# ---------------------------------------------------------------- tables
def fmt(v, spec: str = ".3g", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def fmt_duration(s) -> str:
    if not is_number(s):
        return "–"
    if s < 60:
        return f"{s:.1f}s"
    h, rest = divmod(int(round(s)), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def success_at(r: dict, which: str) -> str:
    v, it = r[f"{which}_heldout_success"], r[f"{which}_heldout_iteration"]
    if v is None:
        return "–"
    return f"{r.get(f'{which}_heldout') or f'{100 * v:.1f}%'} @{it}"  # with its 95% interval where the report has it


RUN_HEADER = ["run", "gate", "seed", "B×G", "iterations", "final held-out", "best held-out", "wall-clock",
              "train reward (uncut)", "won (all)", "groups cut", "zero-variance groups", "step-tokens generated", "step-tokens trained"]
CURVE_HEADER = ["", "held-out success [95% CI] of games", "change", "exact McNemar p"]
PAIR_HEADER = ["gated", "baseline", "seed", "gate", "iterations", "rollout step-tokens saved", "rollout time change",
               "wall-clock change", "groups cut", "grad-norm ratio", "held-out Δ", "train success (baseline → gated)",
               "zero-variance groups (baseline → gated)"]


def run_row(r: dict) -> list[str]:
    return [r["name"], r["gate"], fmt(r["seed"], ""), f"{fmt(r['tasks'], '')}×{fmt(r['group_size'], '')}",
            f"{r['iterations']}/{fmt(r['iterations_planned'], '')}", success_at(r, "final"), success_at(r, "best"),
            fmt_duration(r["wall_clock_s"]), fmt(r["mean_train_reward"], ".3f"), fmt(r["mean_train_success"], ".3f"),
            f"{r['groups_cut']}/{r['groups']}",
            f"{r['zero_variance_groups']} ({r['zero_variance_all_fail']} fail, {r['zero_variance_all_success']} success)",
            f"{r['step_tokens_generated']:,}", f"{r['step_tokens_trained']:,}"]


def pair_row(p: dict) -> list[str]:
    return [Path(p["gated"]).name, Path(p["baseline"]).name, fmt(p["seed"], ""),
            p["gate"] + (" · cut groups in N (zero)" if p.get("cut_groups") == "zero" else ""),
            f"{p['iterations_baseline']} / {p['iterations_gated']}",
            f"{fmt(p['step_tokens_saved_pct'], '.1f', '%')} ({p['step_tokens_baseline']:,} → {p['step_tokens_gated']:,}"
            f" in {p['iterations_compared']} iterations)",
            fmt(p["rollout_s_change_pct"], "+.1f", "%"), fmt(p["wall_clock_change_pct"], "+.1f", "%"),
            str(p["groups_cut"]), grad_norm_ratio(p), heldout_delta(p),
            f"{fmt(p['train_success_baseline'], '.3f')} → {fmt(p['train_success_gated'], '.3f')}",
            f"{p['zero_variance_groups_baseline']} → {p['zero_variance_groups_gated']}"]


POOL_HEADER = ["gate", "seeds", "iterations", "rollout step-tokens saved [95% CI]", "rollout time change",
               "held-out Δ, mean over seeds [95% t interval]", "groups cut vs train success (Spearman)"]


def pool_row(p: dict) -> list[str]:
    held = p["heldout_delta_over_seeds"]
    ci = p["step_tokens_saved_ci95"]
    return [p["gate"] + (" · cut groups in N (zero)" if p["cut_groups"] == "zero" else ""), ", ".join(map(str, p["seeds"])),
            str(p["iterations_compared"]),
            f"{fmt(p['step_tokens_saved_pct'], '.1f', '%')}" + (f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "")
            + f" ({p['step_tokens_baseline']:,} → {p['step_tokens_gated']:,})",
            fmt(p["rollout_s_change_pct"], "+.1f", "%"),
            f"{held['mean']:+.1f} pts [{held['ci95'][0]:+.1f}, {held['ci95'][1]:+.1f}] @{p['heldout_iteration']}" if held else "-",
            f"ρ {rho['rho']:+.2f} (p = {rho['p']:.2g}, {rho['points']} iterations)" if (rho := p.get("cut_share_vs_train_success")) else "-"]


def grad_norm_ratio(p: dict) -> str:
    """The ratio and which norm it is of (a report.json written before the field: the first step's)."""
    which = "steps' mean" if p.get("grad_norm") == GRAD_NORMS["grad_l2_norm_mean"] else "first step"
    return fmt(p["grad_norm_ratio"], ".3f") + (f" ({which})" if p["grad_norm_ratio"] is not None else "")


def heldout_delta(p: dict) -> str:
    """The held-out difference at the last iteration both arms evaluated, paired with its McNemar p
    where both arms' outcomes are there."""
    text = fmt(p["heldout_delta_pts"], "+.1f", " pts")
    if p["heldout_delta_pts"] is not None and p.get("heldout_iteration") is not None:
        text += f" @{p['heldout_iteration']}"
    pair = p.get("heldout_paired")
    return f"{text} (paired on {pair['games']}, p = {pair['mcnemar_p']:.2g})" if pair else text


def tables(rep: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each table, formatted for reading: report_markdown and the CLI print these."""
    out = [("runs", RUN_HEADER, [run_row(r) for r in rep["runs"]]),
           ("mean seconds per iteration", ["run", *PHASES],
            [[r["name"], *(fmt(r["mean_s_per_iteration"][p], ".1f") for p in PHASES)] for r in rep["runs"]])]
    regular = [r for r in rep["runs"] if r.get("kl_coef_field_mean") is not None or r.get("replay_buffer") is not None]
    if regular:
        out.append(("KL to the warm start and success replay (means over iterations)",
                    ["run", "kl_coef", "kl_unit", "per action token (field's unit)", "KL per token", "replay NLL", "replay buffer"],
                    [[r["name"], fmt(r["kl_coef"], ".3g"), str(r["kl_unit"]), fmt(r["kl_coef_field_mean"], ".3g"),
                      fmt(r["kl_mean"], ".3g"), fmt(r["replay_nll_mean"], ".3f"), fmt(r["replay_buffer"], "")] for r in regular]))
    for r in rep["runs"]:
        if r.get("curve"):
            out.append((f"held-out learning curve · {r['name']} (paired with the point before)", CURVE_HEADER,
                        [[c["what"], c["heldout"], fmt(c["change_pts"], "+.1f", " pts"), fmt(c["p"], ".2g")]
                         for c in r["curve"]]))
    if rep["pairs"]:
        out.append(("gated vs baseline, same seed (paper Table 5)", PAIR_HEADER, [pair_row(p) for p in rep["pairs"]]))
    if rep.get("seed_pools"):
        out.append(("gated vs baseline over seeds (Table 5 pooled; intervals: iterations resampled, t over seeds)",
                    POOL_HEADER, [pool_row(p) for p in rep["seed_pools"]]))
    return out


def transposed(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """One row per column, one column per row (named by its first cell): wide tables in a narrow terminal."""
    return ["", *(row[0] for row in rows)], [[name, *(row[i] for row in rows)] for i, name in enumerate(header) if i]


def report_markdown(rep: dict) -> str:
    parts = ["# agentrl report", ""]
    for title, header, rows in tables(rep):
        parts += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        parts += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append("")
    verdicts = [(r["name"], v) for r in rep["runs"] for v in (r.get("warm_start_verdict"), r.get("heldout_verdict")) if v]
    if verdicts:
        parts += ["## held-out success, paired: base model vs warm start, first vs last eval", "", *(f"- {n}: {v}" for n, v in verdicts), ""]
    warnings = [w for r in rep["runs"] for w in r["warnings"]]
    if warnings:
        parts += ["## warnings", "", *(f"- {w}" for w in warnings), ""]
    if rep.get("figures"):
        parts += ["## figures", "", *(f"![{Path(f).stem}]({Path(f).name})" for f in rep["figures"]), ""]
    return "\n".join(parts)
