"""Which signal to read first, per K: the gate's own (d_K) against the best of the others."""

from __future__ import annotations

GATE_SIGNAL = "prefix_edit_distance_mean"  # d_K, the signal the gate thresholds


def signal_choice(correlation: list[dict], by_type: list[dict]) -> list[dict]:
    """Per K (ascending): groups, informative groups, d_K's AUROC and Spearman rho, and the other
    signal whose AUROC is furthest from chance (None when no other has one)."""
    out = []
    for K in sorted({r["K"] for r in correlation}):
        rows = [r for r in correlation if r["K"] == K]
        d = next(r for r in rows if r["metric"] == GATE_SIGNAL)
        others = [r for r in rows if r["metric"] != GATE_SIGNAL and r["auroc"] == r["auroc"]]  # NaN: undefined
        best = max(others, key=lambda r: abs(r["auroc"] - 0.5), default=None)
        out.append({"K": K, "groups": d["N"], "informative": sum(r["informative"] for r in by_type if r["K"] == K),
                    "auroc": d["auroc"], "spearman_rho": d["spearman_rho"],
                    "best_other": None if best is None else (best["metric"], best["auroc"])})
    return out
