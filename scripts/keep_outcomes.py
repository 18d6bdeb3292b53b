"""Keep an eval's per-game outcomes beside a measurement: one line per played game (split, task id,
task type, won), sorted, what `agentrl compare` reads from an eval's episodes.jsonl and nothing
else (no transcripts: a few KB for all 274 held-out games).

A measurement's success counts are in its doc; its outcomes are what a later session needs to
pair or pool it with a new arm (seeds evaluated in different sessions: `agentrl compare A B1 B2`
reads these files as it reads the evals themselves).

    python scripts/keep_outcomes.py EVAL_DIR docs/measurements/outcomes/NAME.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

from agentrl.compare import episode_files
from agentrl.errors import UserError
from agentrl.io import atomic_write_jsonl, read_jsonl

FIELDS = ("split", "task_id", "task_type", "won")


def outcomes(eval_dir: Path) -> list[dict]:
    rows = [r for f in episode_files(eval_dir) for r in read_jsonl(f) if r.get("stop_reason") != "env_error"]
    if any(not isinstance(r.get("won"), bool) for r in rows):  # (with --samples N a game keeps N lines, as compare reads them)
        raise UserError(f"{eval_dir}: an episode row without a won flag")
    return sorted(({k: r.get(k) for k in FIELDS} for r in rows), key=lambda r: (r["split"] or "", r["task_id"]))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        rows = outcomes(Path(argv[0]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(Path(argv[1]), rows)
    print(f"{argv[1]}: {len(rows)} games, {sum(r['won'] for r in rows)} won")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
