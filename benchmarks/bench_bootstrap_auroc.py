"""The bootstrap behind `agentrl analyze`'s AUROC intervals: 1,000 resamples of N groups, each
resample's AUROC as scipy's Mann-Whitney U (one call per resample, as analyze did before
2026-11-29) against `aurocs` (every resample at once, counted over the distinct scores), side by
side in one run; checks they agree exactly.

    python benchmarks/bench_bootstrap_auroc.py [--groups 200] [--resamples 1000]
"""

import argparse
import time

import numpy as np
from scipy.stats import mannwhitneyu

from agentrl.analysis.gate import aurocs


def one_at_a_time(score, positive, draws):
    out = []
    for i in draws:
        a, b = score[i][positive[i]], score[i][~positive[i]]
        out.append(float("nan") if len(a) == 0 or len(b) == 0 else mannwhitneyu(a, b).statistic / (len(a) * len(b)))
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--resamples", type=int, default=1000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    positive = rng.random(args.groups) < 0.4
    score = np.round(rng.normal(size=args.groups) + positive, 2)  # rounded: ties, as d_K's are
    draws = rng.integers(0, args.groups, size=(args.resamples, args.groups))
    t0 = time.perf_counter()
    slow = one_at_a_time(score, positive, draws)
    t1 = time.perf_counter()
    fast = aurocs(score, positive, draws)
    t2 = time.perf_counter()
    assert np.array_equal(slow, fast, equal_nan=True)
    print(f"{args.resamples} resamples of {args.groups} groups: mannwhitneyu each {t1 - t0:.3f} s, "
          f"aurocs at once {t2 - t1:.4f} s: {(t1 - t0) / (t2 - t1):.0f}x; identical: yes")
    print("analyze computes one such bootstrap per signal, K and outcome row (9 signals + 2 classifier rows per K)")


if __name__ == "__main__":
    main()
