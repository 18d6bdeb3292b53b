"""Run totals of a training run's metrics rows: what was generated vs trained, what each selection
stage decided and kept out, and how much advantage the gate's cuts dropped (the audited groups)."""

from __future__ import annotations

from collections import Counter


def run_totals(rows: list[dict]) -> dict | None:
    """Totals over the iteration rows of metrics.jsonl; None for rows without stage records.

    Returns {"tokens": {key: sum}, "advantage": None | {kept_l2, audited_l2, kept_groups,
    audited_groups, dropped_share_mean}, "stages": {name: {decisions, step_tokens_generated,
    step_tokens_excluded, step_tokens_avoided}}} in the last row's stage order."""
    if not rows or "stages" not in rows[-1]:
        return None
    keys = ("trajectories_generated", "trajectories_trained", "step_tokens_generated", "step_tokens_trained",
            "step_tokens_excluded_by_stages", "step_tokens_zero_advantage")
    stages = {}
    for name in rows[-1]["stages"]:
        per = [r["stages"].get(name, {}) for r in rows]
        decisions: Counter = Counter()
        for p in per:
            decisions.update(p.get("decisions", {}))  # update keeps zero counts (a stage that decided nothing)
        stages[name] = {"decisions": dict(decisions), **{k: sum(p.get(k, 0) for p in per) for k in
                        ("step_tokens_generated", "step_tokens_excluded", "step_tokens_avoided")}}
    return {"tokens": {k: sum(r.get(k) or 0 for r in rows) for k in keys}, "advantage": _advantage_dropped(rows),
            "stages": stages}


def _advantage_dropped(rows: list[dict]) -> dict | None:
    """What the gate's cuts dropped, measured on the audited groups (None: nothing audited)."""
    mass = [r["advantage_mass"] for r in rows if r.get("advantage_mass")]
    if not any(m["audited_groups"] for m in mass):
        return None
    shares = [m["dropped_share_est"] for m in mass if m.get("dropped_share_est") is not None]
    return {"kept_l2": sum(m["kept_l2"] ** 2 for m in mass) ** 0.5,
            "audited_l2": sum(m["audited_l2"] ** 2 for m in mass) ** 0.5,
            "kept_groups": sum(m["kept_groups"] for m in mass), "audited_groups": sum(m["audited_groups"] for m in mass),
            "dropped_share_mean": sum(shares) / len(shares)}
