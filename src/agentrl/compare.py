"""`agentrl compare A B`: two evals of the same games, paired.

Each side is an `agentrl eval` output directory (or its episodes.jsonl). A game's outcome is
won (1) or lost (0); with several sampled episodes per game (`agentrl eval --samples N`) it is
the share won. The comparison (agentrl.stats.paired): success of each with its 95% Wilson
interval, the difference B - A in points, the exact McNemar p-value on the discordant games
and which games each side won alone; also per task type.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from agentrl.errors import UserError
from agentrl.io import atomic_write_json
from agentrl.stats import paired


def episodes_file(path: Path) -> Path:
    f = path / "episodes.jsonl" if path.is_dir() else path
    if not f.is_file():
        raise UserError(f"{path}: no episodes.jsonl (give an `agentrl eval --out` directory or its episodes.jsonl)")
    return f


def game_outcomes(path: Path) -> tuple[dict[str, float], dict[str, str]]:
    """({game id: share of its episodes won}, {game id: task type}) of one eval."""
    wins: dict[str, list[float]] = defaultdict(list)
    types: dict[str, str] = {}
    f = episodes_file(path)
    for n, line in enumerate(f.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            game = f"{row.get('split', '')}/{row['task_id']}"
            wins[game].append(1.0 if row["won"] else 0.0)
            types[game] = row.get("task_type", "")
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{f}:{n}: not an episode row of `agentrl eval`") from None
    if not wins:
        raise UserError(f"{f} holds no episodes")
    return {g: sum(v) / len(v) for g, v in wins.items()}, types


def compare(a: Path, b: Path, out: Path | None = None) -> dict:
    outcomes_a, types_a = game_outcomes(a)
    outcomes_b, types_b = game_outcomes(b)
    common = set(outcomes_a) & set(outcomes_b)
    if not common:
        raise UserError(f"{a} and {b} share no game: a paired comparison needs the same games")
    types = types_a | types_b
    result = {"a": str(a), "b": str(b), "overall": paired(outcomes_a, outcomes_b), "by_task_type": {}}
    for tt in sorted({types[g] for g in common}):
        keep = {g for g in common if types[g] == tt}
        result["by_task_type"][tt] = paired({g: outcomes_a[g] for g in keep}, {g: outcomes_b[g] for g in keep})
    if out is not None:
        atomic_write_json(out / "compare.json", result)
    return result


def verdict(r: dict) -> str:
    """One line: whether B differs from A beyond noise (exact McNemar, 5%)."""
    d, p = r["difference_points"], r["mcnemar_p"]
    if p < 0.05:
        return f"B is {'above' if d > 0 else 'below'} A by {abs(d):.1f} points on {r['games']} paired games (McNemar p = {p:.3g} < 0.05)"
    return (f"no difference beyond noise: {d:+.1f} points on {r['games']} paired games (McNemar p = {p:.2f}; "
            f"{len(r['won_only_by_a'])} games won only by A, {len(r['won_only_by_b'])} only by B)")
