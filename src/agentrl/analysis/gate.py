"""Offline analysis of a groups table (groups.csv): how well each signal at step K predicts
whether a group carries learning signal, and what the gate CUT_{K,d_L} would save.

A group is *informative* (positive class) when its G final rewards are not all equal
(non-zero variance); a correct cut removes a zero-variance group. Works on any table with
the groups.csv columns, so tables produced elsewhere can be analysed too.

Every statistic at K reads the groups the live gate decides on: those with a trajectory still
running after step K (termination_fraction < 1). A group that finished by K is left alone by the
gate (nothing to save), so it is neither cut nor counted in a precision, recall or AUROC here;
on a policy that wins, most all-success groups finish early, and counting them would credit a
cut with groups it never takes and steps nobody would have run. Savings are shares of the whole
rollout. With trajectories.jsonl beside the table, each cut's saving is also measured in
step-tokens (the tokens its groups generated after step K, as Tier 1 counts them), not only by
the paper's formula TP (T_max - K) / (N T_max), which assumes every cut row would run to T_max.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as sps

from agentrl.config import RolloutConfig
from agentrl.errors import UserError
from agentrl.io import atomic_write_json, atomic_write_text, read_jsonl_numbered
from agentrl.rollout.signals import SIGNALS
from agentrl.select.classifier_gate import FOLDS, cross_fitted, row_ended
from agentrl.specs import PAPER_SIGNALS, convergence_score, parse_gate
from agentrl.train.advantage import Advantage, group_advantages

REQUIRED = ("task_id", "task_type", "K", *PAPER_SIGNALS, "rewards")  # issue 49's two signals: read where present
D_L_GRID = tuple(round(x, 2) for x in np.arange(0.02, 0.601, 0.02))
SWEEP_COLUMNS = ["K", "d_L", "N", "running", "cut", "TP", "FP", "precision", "recall", "safe_pct", "raw_pct",
                 "tokens_safe_pct", "tokens_pct", "adv_l2_kept", "gigpo_l2_kept"]


@dataclass
class Table:
    K: np.ndarray  # [N]
    signals: dict[str, np.ndarray]  # name -> [N], in SIGNALS' order: the signals the table has
    rewards: list[np.ndarray]
    task_id: list[str]
    task_type: list[str]
    gigpo_sq: np.ndarray | None = None  # [N] the group's GiGPO advantage mass (trajectories.jsonl beside the table)
    tokens_after: np.ndarray | None = None  # [N] the group's step-tokens after step K (trajectories.jsonl beside it)
    tokens_total: np.ndarray | None = None  # [N] the group's step-tokens, all steps

    @property
    def variance(self) -> np.ndarray:
        return np.array([r.var() for r in self.rewards])

    @property
    def informative(self) -> np.ndarray:
        return self.variance > 0

    @property
    def running(self) -> np.ndarray:
        """A trajectory of the group still ran after step K: the groups the live gate decides on."""
        return self.signals["termination_fraction"] < 1

    def at(self, K: int) -> "Table":
        m = self.K == K
        idx = np.flatnonzero(m)
        opt = {k: None if v is None else v[m] for k, v in (("gigpo_sq", self.gigpo_sq), ("tokens_after", self.tokens_after),
                                                          ("tokens_total", self.tokens_total))}
        return Table(self.K[m], {k: v[m] for k, v in self.signals.items()}, [self.rewards[i] for i in idx],
                     [self.task_id[i] for i in idx], [self.task_type[i] for i in idx], **opt)


def read_groups(path: Path) -> Table:
    """Parse and validate groups.csv; every problem is a one-line UserError naming the line."""
    if not path.is_file():
        raise UserError(f"groups table not found: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path}: missing columns {', '.join(missing)} (need {', '.join(REQUIRED)})")
        K, sig, rewards, ids, types = [], {s: [] for s in SIGNALS if s in reader.fieldnames}, [], [], []
        for line, row in enumerate(reader, start=2):
            try:
                K.append(int(row["K"]))
                for s in sig:
                    sig[s].append(float(row[s]))
                r = np.array([float(x) for x in row["rewards"].split(";")])
            except (TypeError, ValueError) as e:
                raise UserError(f"{path}:{line}: bad value ({e})") from None
            if len(r) < 2:
                raise UserError(f"{path}:{line}: a group needs at least 2 rewards, got {row['rewards']!r}")
            rewards.append(r)
            ids.append(row["task_id"])
            types.append(row["task_type"])
    if not K:
        raise UserError(f"{path}: no rows")
    return Table(np.array(K), {s: np.array(v) for s, v in sig.items()}, rewards, ids, types)


def read_trajectories(path: Path, t: Table) -> None:
    """From the trajectories.jsonl that `agentrl rollout` writes beside groups.csv (read once), per
    row of the table: the group's GiGPO advantage mass (the sum over its trajectories' steps of
    A(i, t)^2, `--advantage gigpo`'s defaults) and its step-tokens after the row's K and in all
    (sums of `step_tokens[K:]` and `step_tokens`, as Tier 1's oracle counts them). Left None when
    there is no such file."""
    from collections import defaultdict
    from types import SimpleNamespace

    if not path.is_file():
        return
    by_task: dict[str, list] = defaultdict(list)
    for n, r in read_jsonl_numbered(path, bad="not a trajectory record"):
        try:
            steps = [SimpleNamespace(observation=s["observation"], valid=s["valid"]) for s in r["step_records"]]
            by_task[r["task_id"]].append(SimpleNamespace(reward=float(r["reward"]), initial_observation=r["initial_observation"],
                                                         steps=steps, step_tokens=[int(x) for x in r["step_tokens"]]))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: not a trajectory record ({e.__class__.__name__}: {e})") from None
    fn = Advantage("gigpo")
    mass = {task: sum(x * x for a in fn.of_group(SimpleNamespace(trajectories=trajs)) for x in a)
            for task, trajs in by_task.items()}

    def tokens(task: str, K: int) -> float:  # K = 0: all steps
        trajs = by_task.get(task)
        return float("nan") if trajs is None else float(sum(sum(tr.step_tokens[K:]) for tr in trajs))

    t.gigpo_sq = np.array([mass.get(task, np.nan) for task in t.task_id])
    t.tokens_after = np.array([tokens(task, int(K)) for task, K in zip(t.task_id, t.K)])
    t.tokens_total = np.array([tokens(task, 0) for task in t.task_id])


def auroc(score: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties half (Mann-Whitney U)."""
    return float(aurocs(score, positive, np.arange(len(score))[None, :])[0])


def aurocs(score: np.ndarray, positive: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """`auroc` of each resample at once (a row of `draws` indexes `score`): U counted over the
    distinct scores, U = sum over values v of positives(v) * (negatives below v + negatives(v) / 2),
    over n_pos * n_neg. NaN where a resample lacks a class or holds a NaN score. (A bootstrap of
    1,000 resamples through scipy's mannwhitneyu took most of `agentrl analyze`'s time.)"""
    draws = np.asarray(draws, dtype=int).reshape(len(draws), -1)
    score, positive = np.asarray(score, dtype=float), np.asarray(positive, dtype=bool)
    if draws.shape[1] == 0:
        return np.full(len(draws), np.nan)
    values, code = np.unique(score, return_inverse=True)
    R, U = len(draws), len(values)
    at = (code.reshape(-1)[draws] + U * np.arange(R)[:, None])  # each drawn group's (resample, value) cell
    lab = positive[draws]
    pos = np.bincount(at[lab], minlength=R * U).reshape(R, U).astype(float)
    neg = np.bincount(at[~lab], minlength=R * U).reshape(R, U).astype(float)
    u = (pos * (np.cumsum(neg, axis=1) - neg + neg / 2)).sum(axis=1)
    n_pos, n_neg = pos.sum(axis=1), neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = u / (n_pos * n_neg)
    out[(n_pos == 0) | (n_neg == 0) | np.isnan(score[draws]).any(axis=1)] = np.nan
    return out


def correlation(t: Table) -> list[dict]:
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        run = sub.running  # the groups the gate decides on at K
        var, pos = sub.variance[run], sub.informative[run]
        for name in sub.signals:
            x = sub.signals[name][run]
            if np.ptp(x) == 0 or np.ptp(var) == 0:
                rho, p = float("nan"), float("nan")
            else:
                res = sps.spearmanr(x, var)
                rho, p = float(res.statistic), float(res.pvalue)
            rows.append({"K": K, "metric": name, "spearman_rho": rho, "p_value": p, "auroc": auroc(x, pos), "N": len(x)})
    return rows


def cut_row(sub: Table, cut: np.ndarray, K: int, d_L: float, t_max: int) -> dict:
    """A cut at K (a mask over the K-table's groups) as the live gate would make it: only groups
    still running at K are taken; precision over those, recall over the zero-variance groups still
    running, savings as shares of the whole rollout (the paper's formula, and measured step-tokens
    where the table has its trajectories)."""
    run = sub.running
    cut = cut & run
    zero = ~sub.informative
    n = len(cut)
    tp, fp = int(np.sum(cut & zero)), int(np.sum(cut & ~zero))
    a_full = np.concatenate([group_advantages(r) for r in sub.rewards])
    a_kept = np.concatenate([group_advantages(r) for r, c in zip(sub.rewards, cut) if not c] or [np.zeros(0)])
    full = np.linalg.norm(a_full)
    saved = max(t_max - K, 0) / (n * t_max) * 100
    g = sub.gigpo_sq
    g_all = float(np.nansum(g)) if g is not None else 0.0
    tok, total = sub.tokens_after, (float(np.nansum(sub.tokens_total)) if sub.tokens_total is not None else 0.0)
    return {
        "K": K, "d_L": d_L, "N": n, "running": int(run.sum()), "cut": int(cut.sum()), "TP": tp, "FP": fp,
        "precision": tp / cut.sum() if cut.sum() else float("nan"),
        "recall": tp / (zero & run).sum() if (zero & run).sum() else float("nan"),
        "safe_pct": tp * saved, "raw_pct": int(cut.sum()) * saved,
        "tokens_safe_pct": 100 * float(np.nansum(tok[cut & zero])) / total if total > 0 else float("nan"),
        "tokens_pct": 100 * float(np.nansum(tok[cut])) / total if total > 0 else float("nan"),
        "adv_l2_kept": float(np.linalg.norm(a_kept) / full) if full > 0 else float("nan"),
        # the same under GiGPO's step-level advantages: a converged all-success group may carry some
        "gigpo_l2_kept": float(np.sqrt(np.nansum(g[~cut]) / g_all)) if g_all > 0 else float("nan"),
    }


DEFAULT_D_L = parse_gate(RolloutConfig.gate).d_L  # the default gate's d_L (the paper's 0.12), a fixed-rule row below
TAU_GRID = (0.5, 0.625, 0.75, 0.875, 1.0)  # the OR-rule's termination-fraction thresholds (G = 8: 4..8 finished)


def signal_table(t: Table, t_max: int, precision_floor: float, seed: int, resamples: int = 1000) -> list[dict]:
    """Which signal predicts a zero-variance group, at each K: per signal (oriented by
    `convergence_score`: lower = more converged, so AUROC > 0.5 = the signal ranks informative
    groups above zero-variance ones) its AUROC with a 95% percentile bootstrap over groups, the
    same against all-fail groups only and against all-success groups only, and the best cut
    "score < t" at or above the precision floor (its threshold, size, precision, recall, safe
    saving). The OR-rule (d_K < t or termination_fraction >= tau) gets its best cut only.
    "classifier": every signal the table has, together, as `--gate K,auto:S1+S2+...` would read them: each
    group scored 1 - P(zero variance) by a logistic regression fitted on the other folds (5-fold
    cross-fitting, so its AUROC and cut are not read off the labels it was fitted on; the bootstrap
    resamples those scores, not the fit). "classifier+guard": the same scores with every group in
    which a row had ended by K (in ALFWorld: won) put above any cut, as the gate's guard spares them."""
    rng = np.random.default_rng(seed)
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        run = sub.running  # the groups the gate decides on at K; the counts and AUROCs below are theirs
        pos = sub.informative
        first = np.array([r[0] for r in sub.rewards])
        all_fail, all_success = run & ~pos & (first == 0), run & ~pos & (first > 0)
        live = np.flatnonzero(run)
        n = len(live)
        draws = live[rng.integers(0, n, size=(resamples, n))] if n else np.zeros((0, 0), dtype=int)
        oracle = cut_row(sub, ~pos, K, 0.0, t_max)  # every zero-variance group still running: what any gate at K bounds
        def score_row(name: str, score: np.ndarray) -> dict:
            boot = aurocs(score, pos, draws) if len(draws) else np.zeros(0)
            boot = boot[boot == boot]
            best = best_cut(sub, score, t_max, K, precision_floor)
            return {"K": K, "signal": name, "N": len(pos), "running": n, "informative": int((pos & run).sum()),
                    "all_fail": int(all_fail.sum()), "all_success": int(all_success.sum()), "auroc": auroc(score[run], pos[run]),
                    "auroc_ci95_low": float(np.quantile(boot, 0.025)) if len(boot) else float("nan"),
                    "auroc_ci95_high": float(np.quantile(boot, 0.975)) if len(boot) else float("nan"),
                    "auroc_vs_all_fail": auroc(score[(pos & run) | all_fail], pos[(pos & run) | all_fail]),
                    "auroc_vs_all_success": auroc(score[(pos & run) | all_success], pos[(pos & run) | all_success]), **best,
                    **cut_at_recall(sub, score, all_fail), "oracle_safe_pct": oracle["safe_pct"],
                    "oracle_tokens_pct": oracle["tokens_safe_pct"]}

        for name in sub.signals:
            rows.append(score_row(name, np.array([convergence_score(name, {name: v}) for v in sub.signals[name]])))
        if n >= 2 * FOLDS and 0 < (pos & run).sum() < n:  # every signal together: the classifier gate's score, cross-fitted
            X = np.column_stack(list(sub.signals.values()))[run]
            held_out = np.full(len(pos), 2.0)  # a finished group: never cut
            held_out[run] = 1.0 - cross_fitted(X, (~pos[run]).astype(float), np.ones(n))
            rows.append(score_row("classifier", held_out))
            # with the gate's guard (select/classifier_gate.py): a group with a row ended by K is never cut
            ended = row_ended(sub.signals)  # elementwise over the groups' arrays
            rows.append(score_row("classifier+guard", np.where(ended, 2.0, held_out)))
        d, tau = sub.signals["prefix_edit_distance_mean"], sub.signals["termination_fraction"]
        cuts = [((d < dl) | (tau >= th), f"d_K<{dl:g} or tau>={th:g}") for dl in (0.0, *D_L_GRID) for th in TAU_GRID]
        best = max((dict(cut_row(sub, c, K, 0.0, t_max), rule=label) for c, label in cuts if (c & run).any()),
                   key=lambda r: (r["precision"] >= precision_floor, r["safe_pct"] if r["precision"] >= precision_floor else -1),
                   default=None)
        ok = best is not None and best["precision"] >= precision_floor
        rule_row = {"K": K, "N": len(pos), "running": n, "informative": int((pos & run).sum()),
                    "all_fail": int(all_fail.sum()), "all_success": int(all_success.sum()), "auroc": float("nan"),
                    "auroc_ci95_low": float("nan"), "auroc_ci95_high": float("nan"), "auroc_vs_all_fail": float("nan"),
                    "auroc_vs_all_success": float("nan"), "all_fail_r50_threshold": "", "all_fail_r50_precision": float("nan"),
                    "oracle_safe_pct": oracle["safe_pct"], "oracle_tokens_pct": oracle["tokens_safe_pct"]}
        rows.append(rule_row | {"signal": "or_rule", "best_threshold": best["rule"] if ok else "", "best_cut": best["cut"] if ok else 0,
                                "best_precision": best["precision"] if ok else float("nan"),
                                "best_recall": best["recall"] if ok else float("nan"), "best_safe_pct": best["safe_pct"] if ok else 0.0,
                                "best_tokens_pct": best["tokens_pct"] if ok else (0.0 if sub.tokens_after is not None else float("nan"))})
        # the fixed rules a user can run as they are (`--gate K,nowin`, `--gate K,0.12`): their cut whatever its precision
        for name, rule in (("nowin", tau == 0), (f"d_K<{DEFAULT_D_L:g}", d < DEFAULT_D_L)):
            r = cut_row(sub, rule, K, 0.0, t_max)
            rows.append(rule_row | {"signal": name, "best_threshold": "fixed", "best_cut": r["cut"], "best_precision": r["precision"],
                                    "best_recall": r["recall"], "best_safe_pct": r["safe_pct"], "best_tokens_pct": r["tokens_pct"]})
    return rows


def cut_at_recall(sub: Table, score: np.ndarray, kind: np.ndarray, recall: float = 0.5) -> dict:
    """Issue 49's all-fail target read off one score: among the cuts `score < t` that remove at
    least `recall` of the groups of one kind (all-fail), the one with the highest precision (the
    share of the cut groups that are zero-variance, as the gate counts it)."""
    zero, best = ~sub.informative, None
    if kind.sum():
        for th in np.unique(score)[1:].tolist() + [float(score.max()) + 1e-9]:
            cut = (score < th) & sub.running
            if (cut & kind).sum() >= recall * kind.sum():
                prec = float((cut & zero).sum() / cut.sum())
                if best is None or prec > best[1]:
                    best = (th, prec)
    return {"all_fail_r50_threshold": round(best[0], 6) if best else "",
            "all_fail_r50_precision": best[1] if best else float("nan")}


def best_cut(sub: Table, score: np.ndarray, t_max: int, K: int, precision_floor: float) -> dict:
    """The cut `score < t` (t between distinct scores) with the largest safe saving at precision >= floor
    (its measured step-token saving beside it, NaN without trajectories)."""
    best = None
    for th in np.unique(score)[1:].tolist() + [float(score.max()) + 1e-9] if len(score) else []:
        r = cut_row(sub, score < th, K, th, t_max)
        if r["cut"] and r["precision"] >= precision_floor and (best is None or r["safe_pct"] > best["safe_pct"]):
            best = r
    if best is None:
        return {"best_threshold": "", "best_cut": 0, "best_precision": float("nan"), "best_recall": float("nan"), "best_safe_pct": 0.0,
                "best_tokens_pct": 0.0 if sub.tokens_after is not None else float("nan")}
    return {"best_threshold": round(best["d_L"], 6), "best_cut": best["cut"], "best_precision": best["precision"],
            "best_recall": best["recall"], "best_safe_pct": best["safe_pct"], "best_tokens_pct": best["tokens_pct"]}


def gate_sweep(t: Table, t_max: int, grid=D_L_GRID) -> list[dict]:
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        d = sub.signals["prefix_edit_distance_mean"]
        rows.extend(cut_row(sub, d < d_L, K, d_L, t_max) for d_L in grid)
    return rows


def operating_point(sweep: list[dict], precision_floor: float) -> dict | None:
    """The (K, d_L) with the largest safe saving among cuts at or above the precision floor."""
    ok = [r for r in sweep if r["cut"] > 0 and r["precision"] >= precision_floor]
    return max(ok, key=lambda r: (r["safe_pct"], -r["K"], -r["d_L"])) if ok else None


def calibration(t: Table, t_max: int, d_L: float, seed: int, repeats: int = 200) -> list[dict]:
    """The gate vs a random cut of the same size (seeded, averaged) vs the oracle (cut iff zero-variance)."""
    rng = np.random.default_rng(seed)
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        gate = (sub.signals["prefix_edit_distance_mean"] < d_L) & sub.running
        rows.append({"method": "gate"} | cut_row(sub, gate, K, d_L, t_max))
        live = np.flatnonzero(sub.running)
        draws = []
        for _ in range(repeats):  # as many groups, drawn among those the gate decides on
            cut = np.zeros(len(gate), bool)
            cut[rng.choice(live, size=int(gate.sum()), replace=False)] = True
            draws.append(cut_row(sub, cut, K, d_L, t_max))
        rows.append({"method": "random"} | {c: _mean([r[c] for r in draws]) for c in SWEEP_COLUMNS})
        rows.append({"method": "oracle"} | cut_row(sub, ~sub.informative, K, d_L, t_max))
    return rows


def _mean(values) -> float:
    v = np.array(values, dtype=float)
    return float("nan") if np.isnan(v).all() else float(np.nanmean(v))


def by_task_type(t: Table) -> list[dict]:
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        types = np.array(sub.task_type)
        for tt in sorted(set(sub.task_type)):
            m = (types == tt) & sub.running
            pos = sub.informative[m]
            rows.append({"K": K, "task_type": tt, "N": int(m.sum()), "informative": int(pos.sum()),
                         "auroc_d_K": auroc(sub.signals["prefix_edit_distance_mean"][m], pos)})
    return rows


def bootstrap(t: Table, t_max: int, d_L: float, seed: int, resamples: int = 1000) -> list[dict]:
    """95% percentile CIs of the savings at d_L for each K, resampling groups (seeded)."""
    rows = []
    for K in sorted(set(t.K.tolist())):
        sub = t.at(K)
        cut = ((sub.signals["prefix_edit_distance_mean"] < d_L) & sub.running).astype(float)
        zero = (~sub.informative).astype(float)
        saved = max(t_max - K, 0) / t_max * 100

        def safe(c, z, axis=-1):
            return np.mean(c * z, axis=axis) * saved

        def raw(c, z, axis=-1):
            return np.mean(c, axis=axis) * saved

        for name, stat in (("safe_pct", safe), ("raw_pct", raw)):
            est = float(stat(cut, zero))
            lo = hi = float("nan")
            if len(cut) >= 2 and np.ptp(cut * (zero if name == "safe_pct" else 1)) > 0:
                res = sps.bootstrap((cut, zero), stat, paired=True, vectorized=True, n_resamples=resamples,
                                    method="percentile", rng=np.random.default_rng(seed))
                lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
            elif len(cut):
                lo = hi = est  # no spread to resample
            rows.append({"K": K, "d_L": d_L, "statistic": name, "estimate": est, "ci95_low": lo, "ci95_high": hi,
                         "resamples": resamples})
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    import io

    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


def figures(t: Table, corr: list[dict], out: Path, K: int, d_L: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ks = sorted(set(t.K.tolist()))
    names = list(t.signals)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, col, title in ((axes[0], "spearman_rho", "Spearman ρ vs reward variance"), (axes[1], "auroc", "AUROC (informative group)")):
        m = np.array([[next(r[col] for r in corr if r["K"] == k and r["metric"] == s) for k in Ks] for s in names])
        im = ax.imshow(m, cmap="RdBu_r", vmin=-1 if col == "spearman_rho" else 0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(Ks)), [f"K={k}" for k in Ks])
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [""] * len(names))
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, "–" if np.isnan(m[i, j]) else f"{m[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_title(title)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    paths.append(out / "signals_heatmap.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    sub = t.at(K) if K in Ks else t.at(Ks[0])
    d, pos = sub.signals["prefix_edit_distance_mean"][sub.running], sub.informative[sub.running]
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(0, 1, 26)
    ax.hist(d[~pos], bins=bins, alpha=0.6, label=f"zero-variance (n={int((~pos).sum())})")
    ax.hist(d[pos], bins=bins, alpha=0.6, label=f"informative (n={int(pos.sum())})")
    ax.axvline(d_L, color="k", ls="--", label=f"d_L = {d_L:g}")
    ax.set_xlabel(f"d_K at K={int(sub.K[0])}")
    ax.set_ylabel("groups")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "d_K_histogram.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


@dataclass
class Analysis:
    correlation: list[dict]
    sweep: list[dict]
    operating: dict | None
    calibration: list[dict]
    by_type: list[dict]
    bootstrap: list[dict]
    figures: list[Path]
    signals: list[dict]


def pooled(tables: Sequence[Path]) -> Table:
    """Several groups tables (rollouts of disjoint tasks with one adapter, e.g. chunks of one
    measurement or calls of several sessions) read as one: the signals they all have, each
    table's GiGPO mass from its own trajectories.jsonl. A task in two tables is an error: its
    groups would count twice."""
    parts = []
    for path in tables:
        t = read_groups(path)
        read_trajectories(path.parent / "trajectories.jsonl", t)
        parts.append((path, t))
    seen: dict[str, Path] = {}
    for path, t in parts:
        for task in dict.fromkeys(t.task_id):
            if task in seen:
                raise UserError(f"task {task} is in {seen[task]} and in {path}: pool rollouts of disjoint tasks "
                                "(`agentrl rollout --skip-tasks`)")
            seen[task] = path
    if len(parts) == 1:
        return parts[0][1]
    names = [n for n in parts[0][1].signals if all(n in t.signals for _, t in parts)]

    def joined(field: str) -> np.ndarray | None:  # from trajectories.jsonl: only where every table has them
        arrays = [getattr(t, field) for _, t in parts]
        return None if any(a is None for a in arrays) else np.concatenate(arrays)

    return Table(np.concatenate([t.K for _, t in parts]), {n: np.concatenate([t.signals[n] for _, t in parts]) for n in names},
                 [r for _, t in parts for r in t.rewards], [x for _, t in parts for x in t.task_id],
                 [x for _, t in parts for x in t.task_type], joined("gigpo_sq"), joined("tokens_after"), joined("tokens_total"))


def analyze(groups_csv: Path | Sequence[Path], out: Path, t_max: int = 30, precision_floor: float = 0.8, seed: int = 0,
            d_L: float | None = None, figure_K: int = 10) -> Analysis:
    """Every table of `agentrl analyze` from one groups table or several pooled (`pooled`)."""
    t = pooled([groups_csv] if isinstance(groups_csv, Path) else list(groups_csv))
    if t_max < 1 or (t.K > t_max).any():
        raise UserError(f"--t-max {t_max} is below the table's largest K ({int(t.K.max())})")
    corr = correlation(t)
    sweep = gate_sweep(t, t_max)
    op = operating_point(sweep, precision_floor)
    chosen = d_L if d_L is not None else (op["d_L"] if op else 0.12)
    cal = calibration(t, t_max, chosen, seed)
    types = by_task_type(t)
    boot = bootstrap(t, t_max, chosen, seed)
    per_signal = signal_table(t, t_max, precision_floor, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "signals.csv", per_signal)
    write_csv(out / "correlation.csv", corr)
    write_csv(out / "gate_sweep.csv", sweep)
    write_csv(out / "calibration.csv", cal)
    write_csv(out / "by_task_type.csv", types)
    write_csv(out / "bootstrap.csv", boot)
    atomic_write_json(out / "operating_point.json", {"precision_floor": precision_floor, "t_max": t_max, "point": op,
                                                     "d_L_used_for_calibration": chosen})
    figs = figures(t, corr, out, op["K"] if op else figure_K, chosen)
    return Analysis(corr, sweep, op, cal, types, boot, figs, per_signal)

