"""Success rates the way the field should read them: a 95% Wilson interval for one eval, and for
two evals of the same games a paired comparison (difference, exact McNemar p-value on the
discordant games, which games each side won alone).

Bottom layer (scipy only): evals, the auto gate, reports and the CLI all use it.
"""

from __future__ import annotations


def wilson(k: int, n: int) -> tuple[float, float] | None:
    """95% Wilson score interval of k successes in n (None for n = 0)."""
    if n == 0:
        return None
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b games won only by A, c only by B. Under the null each
    discordant game is a fair coin, so p = P(Binomial(b + c, 1/2) as or more extreme than b);
    1.0 when no game is discordant."""
    n = b + c
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b, n, 0.5, alternative="two-sided").pvalue)


def rate_text(k: int, n: int) -> str:
    """'12/140 = 8.6% [5.0, 14.4]' (95% Wilson)."""
    ci = wilson(k, n)
    if ci is None:
        return "0/0"
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def bootstrap_mean(values: list[float], seed: int = 0, draws: int = 2000) -> list[float]:
    """95% percentile bootstrap of the mean of per-game values (shares won), resampling games."""
    import numpy as np

    if not values:
        return [0.0, 0.0]
    means = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    boot = means[rng.integers(0, len(means), size=(draws, len(means)))].mean(axis=1)
    return [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]


def bootstrap_saved(baseline: list[float], gated: list[float], seed: int = 0, draws: int = 2000) -> list[float]:
    """95% percentile bootstrap of the share saved, 1 - sum(gated) / sum(baseline), over paired
    units (a learning run's iterations: the same tasks in both arms), resampling the units."""
    import numpy as np

    b, g = np.asarray(baseline, dtype=float), np.asarray(gated, dtype=float)
    if not len(b):
        return [0.0, 0.0]
    idx = np.random.default_rng(seed).integers(0, len(b), size=(draws, len(b)))
    saved = 1 - g[idx].sum(axis=1) / b[idx].sum(axis=1)
    return [float(np.quantile(saved, 0.025)), float(np.quantile(saved, 0.975))]


def seed_interval(differences: list[float]) -> dict:
    """Differences B - A of several training runs (seed s of B against seed s of A, each on the same
    games): their mean and its 95% Student t interval over the seeds. This interval holds the
    runs' own noise, which the interval over games of one pair leaves out; with two seeds it is
    wide (t = 12.7), as it should be. No interval for one seed."""
    from statistics import fmean, stdev

    n = len(differences)
    mean = fmean(differences) if n else 0.0
    if n < 2:
        return {"seeds": n, "mean": mean, "sd": None, "ci95": None}
    from scipy.stats import t

    sd = stdev(differences)
    half = float(t.ppf(0.975, n - 1)) * sd / n ** 0.5
    return {"seeds": n, "mean": mean, "sd": sd, "ci95": (mean - half, mean + half)}


def rank_correlation(x: list[float], y: list[float]) -> dict | None:
    """Spearman's rho of y against x with its two-sided p (scipy): whether y falls or rises as x
    does, whatever the shape. None for fewer than 3 points or a constant side (no ranking)."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    from scipy.stats import spearmanr

    rho, p = spearmanr(x, y)
    return {"points": len(x), "rho": float(rho), "p": float(p)}


def paired(a: dict[str, float], b: dict[str, float]) -> dict:
    """Two evals as {game id: success (0/1, or a share: of N sampled episodes, or of several seeds'
    evals)} compared on the games both ran: n, each side's success, the difference B - A (points),
    the games on which each side did better, and an exact two-sided test over them. With 0/1
    outcomes those are the games each side won alone and the test is exact McNemar; with shares,
    the same test on the games whose shares differ is the exact sign test (games are the
    independent units), and a side with shares gets a bootstrap interval over games instead of
    Wilson's (a side of 0/1 keeps Wilson's, so a warm start reads the same in every comparison).
    Games only one side ran are counted, not compared."""
    common = sorted(set(a) & set(b))
    won_a = {g for g in common if a[g] >= 0.5}
    won_b = {g for g in common if b[g] >= 0.5}
    only_a = [g for g in common if a[g] > b[g]]
    only_b = [g for g in common if b[g] > a[g]]
    n = len(common)
    rate_a = sum(a[g] for g in common) / n if n else 0.0
    rate_b = sum(b[g] for g in common) / n if n else 0.0
    binary = all(a[g] in (0, 1) and b[g] in (0, 1) for g in common)

    def ci(x: dict, won: set):  # each side by its own kind: a single eval's 0/1 keeps Wilson's interval
        if all(x[g] in (0, 1) for g in common):
            return wilson(len(won), n)
        return tuple(bootstrap_mean([x[g] for g in common])) if n else None

    ci_a, ci_b = ci(a, won_a), ci(b, won_b)
    return {
        "games": n, "only_in_a": len(set(a) - set(b)), "only_in_b": len(set(b) - set(a)),
        "success_a": rate_a, "success_b": rate_b, "difference_points": 100 * (rate_b - rate_a),
        "won_a": len(won_a), "won_b": len(won_b),
        "ci95_a": ci_a, "ci95_b": ci_b,
        "won_only_by_a": only_a, "won_only_by_b": only_b,
        "test": "exact McNemar" if binary else "exact sign test over games",
        "mcnemar_p": mcnemar_exact(len(only_a), len(only_b)),
    }


# ---------------------------------------------------------------- in-training eval rows (metrics.jsonl)
def eval_text(r: dict) -> str:
    """'16.7% [3.0, 56.4] of 6' for an eval row (older rows without the count: the rate alone)."""
    n = r.get("tasks", 0)
    k = r.get("won", round(r["success"] * n))
    ci = wilson(k, n) if n else None
    return f"{100 * r['success']:.1f}%" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}] of {n}" if ci else "")


def learning_verdict(evals: list[dict]) -> str | None:
    """One line: did held-out success move beyond noise between the first and the last eval?
    Paired on the games both evaluated (exact McNemar); None with fewer than two evals."""
    evals = sorted(evals, key=lambda r: r["iteration"])
    if len(evals) < 2 or "outcomes" not in evals[0] or "outcomes" not in evals[-1]:
        return None
    first, last = evals[0], evals[-1]
    return paired_line(first, last, f"iteration {first['iteration']}", str(last['iteration']))


def paired_line(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """One line on two eval rows of the same games: success, the paired difference, exact McNemar."""
    r = paired(a["outcomes"], b["outcomes"])
    head = (f"held-out success, {name_a} -> {name_b}: {100 * r['success_a']:.1f}% -> "
            f"{100 * r['success_b']:.1f}% on the same {r['games']} games ({r['difference_points']:+.1f} points; "
            f"{len(r['won_only_by_b'])} game{'' if len(r['won_only_by_b']) == 1 else 's'} newly won, {len(r['won_only_by_a'])} lost; exact McNemar p = {r['mcnemar_p']:.2g}): ")
    if r["mcnemar_p"] < 0.05:
        return head + ("a gain beyond noise" if r["difference_points"] > 0 else "a loss beyond noise")
    return head + "not beyond noise"


def warm_start_verdict(base: dict | None, evals: list[dict]) -> str | None:
    """The warm start's gain: the base model's eval (a `base_eval` row) against iteration 0's, paired."""
    first = next((r for r in sorted(evals, key=lambda r: r["iteration"]) if r["iteration"] == 0), None)
    if base is None or first is None or "outcomes" not in base or "outcomes" not in first:
        return None
    return paired_line(base, first, "base model", "warm start (iteration 0)")


__all__ = ["bootstrap_mean", "bootstrap_saved", "eval_text", "learning_verdict", "mcnemar_exact", "paired", "paired_line", "rate_text",
           "seed_interval", "warm_start_verdict", "wilson"]
