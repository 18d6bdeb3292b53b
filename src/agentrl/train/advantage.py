"""Advantages per group (Eq. 1 of the paper): A_i = (r_i - mean) / (std + eps), population std.

Cut groups never enter the batch. A zero-variance group gets A = 0 for every trajectory:
it teaches nothing, which is why the gate may stop it early.
"""

from __future__ import annotations

import numpy as np

from agentrl.config import ADVANTAGES as ESTIMATORS


def group_advantages(rewards, estimator: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if estimator == "grpo":
        return (r - r.mean()) / (r.std() + eps)
    if estimator == "dr_grpo":  # no std division
        return r - r.mean()
    if estimator == "rloo":  # leave-one-out baseline
        n = len(r)
        return r - (r.sum() - r) / (n - 1) if n > 1 else np.zeros_like(r)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def batch_advantages(groups, estimator: str = "grpo", dapo_filter: bool = False) -> list[tuple[object, float]]:
    """(trajectory, advantage) for every trajectory that reaches the loss: cut groups and groups a
    selection stage excluded (`excluded_by`) never enter; with `dapo_filter` neither do the
    remaining zero-variance groups (`agentrl train` applies that filter as a stage, select/dapo.py)."""
    out = []
    for g in groups:
        if g.cut or getattr(g, "excluded_by", None) or (dapo_filter and g.zero_variance):
            continue
        out.extend(zip(g.trajectories, group_advantages(g.rewards, estimator).tolist()))
    return out
