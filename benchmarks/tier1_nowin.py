"""Tier 1 offline, for the no-win gate, from ungated rollouts: what `--gate K,nowin` would cut and save.

Reads the trajectories.jsonl of one or more ungated `agentrl rollout` outputs (e.g. the chunks of
`benchmarks/bench_gate_signals.sh`) and prints, per K: the policy's train success (Wilson 95%),
the group kinds, the oracle's saving (every zero-variance group still running at K cut) and the
no-win rule's cut (a group still running at K with no row won by step K), as shares of the
rollout's step-tokens, with 95% percentile bootstrap intervals over groups: its precision
(Wilson), the step-tokens it saves in all and in its zero-variance groups, that part as a share of
the oracle's, the informative groups it takes and the GRPO advantage mass (L2) it keeps.

The no-win rule depends only on the ungated rows' prefixes up to K, and a gated arm's rows take
their baseline rows' actions (the sampler's per-row counter-based seeds), so these are the live
gate's numbers: `agentrl analyze` prints the same cut and shares, without these intervals.

    python benchmarks/tier1_nowin.py RUN/chunk0 RUN/chunk1 ... [--exclude TASK_ID ...] [--k 3 5 10 15 20]

--exclude drops tasks (e.g. ones an RL run trained on, replayed from its seeded task sampler).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from agentrl.analysis.gate import group_advantages
from agentrl.stats import wilson


def load(dirs: list[Path], exclude: set[str]) -> list[list[tuple[bool, int, list[int]]]]:
    groups: dict[str, list] = {}
    for d in dirs:
        for line in (d / "trajectories.jsonl").open():
            r = json.loads(line)
            if r["task_id"] not in exclude:
                groups.setdefault(r["task_id"], []).append((r["reward"] > 0, int(r["steps"]), [int(x) for x in r["step_tokens"]]))
    return list(groups.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--exclude", nargs="*", default=[])
    ap.add_argument("--k", nargs="*", type=int, default=[3, 5, 10, 15, 20])
    ap.add_argument("--resamples", type=int, default=2000)
    a = ap.parse_args()
    G = load(a.runs, set(a.exclude))
    n = len(G)
    won = sum(w for g in G for w, _, _ in g)
    N = sum(len(g) for g in G)
    lo, hi = wilson(won, N)
    wins = np.array([sum(w for w, _, _ in g) for g in G])
    size = np.array([len(g) for g in G])
    zero, all_fail = (wins == 0) | (wins == size), wins == 0
    print(f"{n} groups, {N} trajectories: won {won} = {100 * won / N:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]; "
          f"informative {int((~zero).sum())}, all-fail {int(all_fail.sum())}, all-success {int((zero & ~all_fail).sum())}")
    total = np.array([sum(sum(t) for _, _, t in g) for g in G], float)
    adv_sq = np.array([float(np.sum(np.square(group_advantages([float(w) for w, _, _ in g])))) for g in G])
    B = np.random.default_rng(0).integers(0, n, size=(a.resamples, n))

    def share(x: np.ndarray, of: np.ndarray) -> str:
        v = np.percentile([x[b].sum() / of[b].sum() * 100 for b in B if of[b].sum() > 0], [2.5, 97.5])
        return f"{x.sum() / of.sum() * 100:.1f}% [{v[0]:.1f}, {v[1]:.1f}]"

    print(f"step-tokens in all: {int(total.sum()):,}")
    for K in a.k:
        m = at_K(G, K)
        running, cut, after, oracle = m["running"], m["cut"], m["after"], m["oracle"]
        tp, c = int((cut & zero).sum()), int(cut.sum())
        p = f"{tp / c:.2f} [{wilson(tp, c)[0]:.2f}, {wilson(tp, c)[1]:.2f}]" if c else "-"
        kept = np.percentile([np.sqrt(adv_sq[b][~cut[b]].sum() / adv_sq[b].sum()) for b in B], [2.5, 97.5])
        print(f"K {K:2d}: running {int(running.sum())} (zero-variance {int((zero & running).sum())}: all-fail "
              f"{int((all_fail & running).sum())}, all-success {int((zero & ~all_fail & running).sum())}); "
              f"oracle {share(oracle, total)}")
        print(f"      nowin: cut {c}, precision {p}, all-fail recall {int((cut & all_fail).sum())}/{int(all_fail.sum())}; "
              f"saves {share(after * cut, total)}, its zero-variance part {share(after * cut * zero, total)} "
              f"= {share(after * cut * zero, oracle)} of the oracle; informative cut {c - tp} of {int((~zero).sum())}; "
              f"advantage L2 kept {np.sqrt(adv_sq[~cut].sum() / adv_sq.sum()):.3f} [{kept[0]:.3f}, {kept[1]:.3f}]")


def at_K(G: list, K: int) -> dict:
    """Per group, at K: still running (a row past step K), cut by the no-win rule (running, no row
    won by step K), the step-tokens after K, and the oracle's share of them (zero-variance and running)."""
    wins = np.array([sum(w for w, _, _ in g) for g in G])
    zero = (wins == 0) | (wins == np.array([len(g) for g in G]))
    running = np.array([any(steps > K for _, steps, _ in g) for g in G])
    won_by_K = np.array([any(w and steps <= K for w, steps, _ in g) for g in G])
    after = np.array([sum(sum(t[K:]) for _, _, t in g) for g in G], float)
    return {"running": running, "cut": running & ~won_by_K, "after": after, "oracle": after * (zero & running)}


if __name__ == "__main__":
    main()
