"""`agentrl compare A B`: two evals of the same games, paired.

Each side is an `agentrl eval` output directory (or its episodes.jsonl), or a directory of such
directories, one per split (bench_learning's `eval/RUN/` holds valid_seen/ and valid_unseen/): its
games are those of every split, each game named by split and id. A game's outcome is
won (1) or lost (0); with several sampled episodes per game (`agentrl eval --samples N`) it is
the share won. B may be several evals of the same games (one policy trained with several
seeds): a game's outcome is then its mean over them. The comparison (agentrl.stats.paired):
success of each with its 95% interval, the difference B - A in points, an exact test on the
games one side did better on (McNemar for 0/1 outcomes, the sign test for shares) and which
games those are; also per task type.

`agentrl compare A0 A1 A2 vs B0 B1 B2`: two arms trained with the same seeds (a gated arm and
its ungated twin, say). Each side is pooled per game as above, and seed s of A is also paired
with seed s of B: each pair's difference and McNemar p, and their mean over the seeds with a t
interval over the seeds (agentrl.stats.seed_interval). An interval over games holds one
training run fixed; the one over seeds also holds how far the runs themselves move.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from agentrl.errors import UserError
from agentrl.io import atomic_write_json, read_jsonl_numbered
from agentrl.machine import numerics
from agentrl.stats import paired, seed_interval

SEP = "vs"  # `compare A0 A1 vs B0 B1`: the word between the two arms' seeds


def episode_files(path: Path) -> list[Path]:
    """The episodes.jsonl of one eval, or of each eval (split) directly under `path`."""
    if path.is_file():
        return [path]
    if (path / "episodes.jsonl").is_file():
        return [path / "episodes.jsonl"]
    found = sorted(path.glob("*/episodes.jsonl")) if path.is_dir() else []
    if not found:
        raise UserError(f"{path}: no episodes.jsonl (give an `agentrl eval --out` directory, its episodes.jsonl, "
                        "or a directory of them, one per split)")
    return found


def eval_numerics(path: Path) -> set[str]:
    """The numerics each eval of `path` ran at ("float32 on cpu (AVX2)"), from the summary.json beside
    its episodes; empty where none says (an older eval, or kept outcomes)."""
    found = set()
    for f in episode_files(path):
        try:
            record = json.loads((f.parent / "summary.json").read_text()).get("machine")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(record, dict):
            found.add(numerics(record))
    return found


def game_outcomes(path: Path) -> tuple[dict[str, float], dict[str, str]]:
    """({game id: share of its episodes won}, {game id: task type}) of one eval (or of its splits)."""
    wins: dict[str, list[float]] = defaultdict(list)
    types: dict[str, str] = {}
    first_seen: dict[str, Path] = {}
    for f in episode_files(path):
        for n, row in read_jsonl_numbered(f, bad="not an episode row of `agentrl eval`"):
            try:
                game = f"{row.get('split', '')}/{row['task_id']}"
                if row.get("stop_reason") == "env_error":  # not played: no outcome to pair
                    continue
                wins[game].append(1.0 if row["won"] else 0.0)
                types[game] = row.get("task_type", "")
            except (ValueError, KeyError, TypeError):
                raise UserError(f"{f}:{n}: not an episode row of `agentrl eval`") from None
            # one game in two evals of a directory would count twice as samples of one policy
            if first_seen.setdefault(game, f) != f:
                raise UserError(f"{path}: game {game} is in both {first_seen[game]} and {f} (one eval per split)")
    if not wins:
        raise UserError(f"{path} holds no played episodes")
    return {g: sum(v) / len(v) for g, v in wins.items()}, types


def pooled_outcomes(paths: list[Path], evals: list[tuple[dict[str, float], dict[str, str]]]) -> tuple[dict[str, float], dict[str, str]]:
    """Several evals of one policy (seeds; `evals` their game_outcomes, in the order of `paths`) as
    one: a game's outcome is its mean over them. They must hold the same games, or the mean would
    mix games seen by some seeds only."""
    (outcomes, types), *more = evals
    sums = dict(outcomes)
    types = dict(types)
    for p, (other, other_types) in zip(paths[1:], more):
        if set(other) != set(outcomes):
            raise UserError(f"{p} and {paths[0]} hold different games: evals pooled on one side must cover the same games")
        for g, v in other.items():
            sums[g] += v
        types |= other_types
    return {g: v / len(paths) for g, v in sums.items()}, types


def split_arms(a: Path, b: list[Path]) -> tuple[list[Path], list[Path]]:
    """The CLI's `A B [B ...]` or `A [A ...] vs B [B ...]` as (A's evals, B's evals)."""
    cut = [i for i, p in enumerate(b) if str(p) == SEP]
    if not cut:
        return [a], list(b)
    if len(cut) > 1:
        raise UserError(f"`{SEP}` twice: give `A [A ...] {SEP} B [B ...]`")
    left, right = [a, *b[:cut[0]]], b[cut[0] + 1:]
    if not right:
        raise UserError(f"nothing after `{SEP}`: give `A [A ...] {SEP} B [B ...]`")
    return left, right


def compare(a: Path | list[Path], b: Path | list[Path], out: Path | None = None) -> dict:
    as_ = [a] if isinstance(a, Path) else list(a)
    bs = [b] if isinstance(b, Path) else list(b)
    if len(as_) > 1 and len(bs) > 1 and len(as_) != len(bs):
        raise UserError(f"{len(as_)} evals of A against {len(bs)} of B: arms paired by seed need one eval per seed "
                        "on each side, in the same order")
    evals_a, evals_b = [game_outcomes(p) for p in as_], [game_outcomes(p) for p in bs]  # each file read once
    outcomes_a, types_a = pooled_outcomes(as_, evals_a)
    outcomes_b, types_b = pooled_outcomes(bs, evals_b)
    common = set(outcomes_a) & set(outcomes_b)
    if not common:
        raise UserError(f"{as_[0]} and {bs[0]} share no game: a paired comparison needs the same games")
    types = types_a | types_b

    def paired_by(key) -> dict:  # the common games grouped by key(game), each group paired
        groups = defaultdict(list)
        for g in common:
            groups[key(g)].append(g)
        return {k: paired({g: outcomes_a[g] for g in gs}, {g: outcomes_b[g] for g in gs}) for k, gs in sorted(groups.items())}

    result = {"a": " + ".join(map(str, as_)), "b": " + ".join(map(str, bs)), "a_evals": len(as_), "b_evals": len(bs),
              "overall": paired(outcomes_a, outcomes_b), "by_task_type": paired_by(types.__getitem__)}
    by_split = paired_by(lambda g: g.split("/", 1)[0])  # game_outcomes names a game split/id
    if len(by_split) > 1:
        result["by_split"] = by_split
    seen_a, seen_b = (set().union(*map(eval_numerics, side)) for side in (as_, bs))
    if seen_a and seen_b and seen_a != seen_b:  # other bits: part of the difference is the machine, not the policy
        result["numerics"] = {"a": sorted(seen_a), "b": sorted(seen_b)}
    if len(as_) == len(bs) > 1:
        result["by_seed"] = by_seed(as_, bs, [o for o, _ in evals_a], [o for o, _ in evals_b])
    if out is not None:
        atomic_write_json(out / "compare.json", result)
    return result


def by_seed(as_: list[Path], bs: list[Path], outcomes_a: list[dict], outcomes_b: list[dict]) -> dict:
    """Seed s of A against seed s of B, each pair on the same games (pooled_outcomes has checked
    that each side's evals hold the same games), and the pairs' mean difference over the seeds."""
    pairs = []
    for a, b, oa, ob in zip(as_, bs, outcomes_a, outcomes_b):
        r = paired(oa, ob)
        pairs.append({"a": str(a), "b": str(b)} | {k: r[k] for k in (
            "games", "won_a", "won_b", "success_a", "success_b", "difference_points", "mcnemar_p")} | {
            "won_only_by_a": len(r["won_only_by_a"]), "won_only_by_b": len(r["won_only_by_b"])})
    return {"pairs": pairs, "difference_points": seed_interval([p["difference_points"] for p in pairs])}


def seed_verdict(r: dict) -> str:
    """One line on the arms' difference over the seeds: its mean and t interval, and whether the
    interval leaves zero out."""
    d = r["by_seed"]["difference_points"]
    lo, hi = d["ci95"]
    head = f"over {d['seeds']} seeds, B - A: {d['mean']:+.1f} points, 95% t interval over the seeds [{lo:+.1f}, {hi:+.1f}]"
    if lo > 0 or hi < 0:
        return head + f": B is {'above' if lo > 0 else 'below'} A"
    return head + ": no difference beyond the seeds' spread"


def verdict(r: dict) -> str:
    """One line: whether B differs from A beyond noise (exact McNemar or sign test, 5%)."""
    d, p = r["difference_points"], r["mcnemar_p"]
    test = "McNemar" if r.get("test", "exact McNemar") == "exact McNemar" else "sign test"
    if p < 0.05:
        return f"B is {'above' if d > 0 else 'below'} A by {abs(d):.1f} points on {r['games']} paired games ({test} p = {p:.3g} < 0.05)"
    better = ("won only by A", "only by B") if test == "McNemar" else ("better for A", "better for B")
    return (f"no difference beyond noise: {d:+.1f} points on {r['games']} paired games ({test} p = {p:.2f}; "
            f"{len(r['won_only_by_a'])} games {better[0]}, {len(r['won_only_by_b'])} {better[1]})")
