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


def paired(a: dict[str, float], b: dict[str, float]) -> dict:
    """Two evals as {game id: success (0/1, or a share of N sampled episodes)} compared on the games
    both ran: n, each side's successes, the difference B - A (points), the exact McNemar p-value
    on the games one side won and the other lost (shares are rounded: won = share >= 0.5), and
    the games each side won alone. Games only one side ran are counted, not compared."""
    common = sorted(set(a) & set(b))
    won_a = {g for g in common if a[g] >= 0.5}
    won_b = {g for g in common if b[g] >= 0.5}
    only_a, only_b = sorted(won_a - won_b), sorted(won_b - won_a)
    n = len(common)
    rate_a = sum(a[g] for g in common) / n if n else 0.0
    rate_b = sum(b[g] for g in common) / n if n else 0.0
    return {
        "games": n, "only_in_a": len(set(a) - set(b)), "only_in_b": len(set(b) - set(a)),
        "success_a": rate_a, "success_b": rate_b, "difference_points": 100 * (rate_b - rate_a),
        "won_a": len(won_a), "won_b": len(won_b),
        "ci95_a": wilson(len(won_a), n), "ci95_b": wilson(len(won_b), n),
        "won_only_by_a": only_a, "won_only_by_b": only_b,
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
    r = paired(first["outcomes"], last["outcomes"])
    head = (f"held-out success, iteration {first['iteration']} -> {last['iteration']}: {100 * r['success_a']:.1f}% -> "
            f"{100 * r['success_b']:.1f}% on the same {r['games']} games ({r['difference_points']:+.1f} points; "
            f"{len(r['won_only_by_b'])} games newly won, {len(r['won_only_by_a'])} lost; exact McNemar p = {r['mcnemar_p']:.2g}): ")
    if r["mcnemar_p"] < 0.05:
        return head + ("a gain beyond noise" if r["difference_points"] > 0 else "a loss beyond noise")
    return head + "not beyond noise"


__all__ = ["eval_text", "learning_verdict", "mcnemar_exact", "paired", "rate_text", "wilson"]
