"""Game discovery: the official alfworld-download layout, read directly from game.tw-pddl.

json_2.1.1/<split>/<task_type>-<obj>-<mrecep>-<recep>-<scene>/<trial>/game.tw-pddl
The task type is the directory prefix before the first '-'. We do not use traj_data.json
or alfworld's own AlfredTWEnv discovery (it finds no train games without traj_data.json).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import SPLITS, TASK_TYPES, check_task_type
from agentrl.errors import UserError

log = logging.getLogger(__name__)

GAME_FILE = "game.tw-pddl"
HOW_TO_GET = "get it with `agentrl data download` or point --data / ALFWORLD_DATA at an existing copy"


# A task directory is <task_type>-<Object>-<MovableReceptacle>-<Receptacle or Toggle>-<scene>: what
# ALFWorld's traj_data.json gives the expert as its pddl_params (the TW games ship without it).
TASK_DIR = re.compile(r"^(?P<type>[a-z_]+)-(?P<object>[A-Za-z]+)-(?P<mrecep>[A-Za-z]+)-(?P<parent>[A-Za-z]+)-\d+$")


@dataclass(frozen=True)
class Game:
    """One ALFWorld game (a trial folder). `game_id` is `<task dir>/<trial>`, unique within a split."""

    game_id: str
    split: str
    task_type: str
    path: Path
    walkthrough: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # walkthrough steps played but not taught: a decoy visit's `go to` (env/decoy.py), an arbitrary choice
    untaught: tuple[int, ...] = field(default=(), compare=False, repr=False)


def task_dir(game: Game) -> re.Match | None:
    """The game's task directory (the first part of its id) read as TASK_DIR; None where it is not
    one of the game's task type (synthetic games)."""
    m = TASK_DIR.match(game.game_id.split("/")[0])
    return m if m and m["type"] == game.task_type else None


def task_object(game: Game) -> str | None:
    """The task's object type in lower case, as observations and commands name it (`butterknife`);
    None where the game has no task directory."""
    m = task_dir(game)
    return m["object"].lower() if m else None


def resolve_data_root(data: str | os.PathLike | None = None) -> Path:
    """--data, else $ALFWORLD_DATA, else ~/.cache/alfworld. The root holds json_2.1.1/."""
    if data:
        return Path(data).expanduser()
    if os.environ.get("ALFWORLD_DATA"):
        return Path(os.environ["ALFWORLD_DATA"]).expanduser()
    return Path("~/.cache/alfworld").expanduser()


def split_dir(root: Path, split: str) -> Path:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if not root.is_dir():
        raise UserError(f"no ALFWorld data at {root} (looked at --data, then $ALFWORLD_DATA, then ~/.cache/alfworld); "
                        f"{_unpack_hint(root)}{HOW_TO_GET}")
    d = root / "json_2.1.1" / split
    if not d.is_dir():
        raise UserError(f"ALFWorld split {split!r} not found: {d} does not exist; {HOW_TO_GET}")
    return d


def _unpack_hint(root: Path) -> str:
    """A root that is unpacked by a script beside it (../shared/data/alfworld-full.sh makes
    alfworld-full, once per machine): name the script, the likeliest cure."""
    script = root.with_name(root.name + ".sh")
    return f"`bash {script}` unpacks it and prints where (point ALFWORLD_DATA there), or " if script.is_file() else ""


def task_type_of(task_dir_name: str) -> str:
    return task_dir_name.split("-", 1)[0]


def iter_game_files(root: Path, split: str) -> Iterator[Path]:
    """Every game.tw-pddl of a split, in sorted (deterministic) order."""
    d = split_dir(root, split)
    for task_dir in sorted(p for p in d.iterdir() if p.is_dir()):
        for trial in sorted(p for p in task_dir.iterdir() if p.is_dir()):
            f = trial / GAME_FILE
            if f.is_file():
                yield f


def read_game(path: Path, split: str) -> Game:
    """Parse one game file. Raises ValueError with the reason if it is corrupt."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("pddl_domain", "pddl_problem", "grammar") if k not in data]
    if missing:
        raise ValueError(f"missing keys {missing}")
    walkthrough = data.get("walkthrough") or []
    if not data.get("solvable", False):
        raise NotSolvable()
    task_dir, trial = path.parent.parent.name, path.parent.name
    return Game(
        game_id=f"{task_dir}/{trial}",
        split=split,
        task_type=task_type_of(task_dir),
        path=path,
        walkthrough=tuple(str(a) for a in walkthrough),
    )


def round_robin(games: list[Game], n: int | None) -> list[Game]:
    """n games taking one of each task type in turn (all games when n is None): the warm start's
    selection (`agentrl sft --games N`, `agentrl data replay --games N`)."""
    by_type = {t: [g for g in games if g.task_type == t] for t in TASK_TYPES}
    by_type = {t: gs for t, gs in by_type.items() if gs}
    out, i = [], 0
    while by_type and (n is None or len(out) < n):
        progressed = False
        for t in list(by_type):
            if i < len(by_type[t]) and (n is None or len(out) < n):
                out.append(by_type[t][i])
                progressed = True
        if not progressed:
            break
        i += 1
    return out


def spread(games: list[Game], per_type: int | None) -> list[Game]:
    """At most `per_type` games of each task type, spread evenly over the type's games in their
    order (game floor(i n / per_type) of its n, i = 0 .. per_type - 1); None: all. This is how the
    600-game train set of ../shared/data/alfworld was drawn from the 3,553 (100 per type), so
    `sft.spread 100` picks the same games from either root (docs/warm-start.md)."""
    if per_type is None:
        return list(games)
    out = []
    for t in dict.fromkeys(g.task_type for g in games):
        of_type = [g for g in games if g.task_type == t]
        n = len(of_type)
        out += of_type if n <= per_type else [of_type[i * n // per_type] for i in range(per_type)]
    return out


class NotSolvable(Exception):
    pass


@dataclass
class Discovery:
    games: list[Game]
    corrupt: list[tuple[Path, str]]
    unsolvable: list[Path]


def interleave_by_type(paths: list[Path]) -> list[Path]:
    """Round-robin over task types (each type in path order): the first N games cover every type."""
    by_type: dict[str, list[Path]] = {}
    for f in paths:
        by_type.setdefault(task_type_of(f.parent.parent.name), []).append(f)
    queues = [by_type[t] for t in sorted(by_type, key=lambda t: TASK_TYPES.index(t) if t in TASK_TYPES else len(TASK_TYPES))]
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def scan_split(root: Path, split: str, task_types: Iterable[str] = (), limit: int | None = None) -> Discovery:
    """Games of a split, filtered by task type and by solvable; corrupt files are listed, not raised
    (`agentrl data check` reports them; `discover_games` refuses them).

    Order: round-robin over task types, each type sorted by path (deterministic).
    """
    wanted = {check_task_type(t) for t in task_types} or set(TASK_TYPES)
    paths = [f for f in iter_game_files(root, split) if task_type_of(f.parent.parent.name) in wanted]
    out = Discovery([], [], [])
    for f in interleave_by_type(paths):
        if limit is not None and len(out.games) >= limit:
            break
        try:
            out.games.append(read_game(f, split))
        except NotSolvable:
            out.unsolvable.append(f)
        except ValueError as e:
            out.corrupt.append((f, str(e)))
    return out


def discover_games(
    split: str,
    data: str | os.PathLike | None = None,
    task_types: Iterable[str] = (),
    limit: int | None = None,
) -> list[Game]:
    """Solvable games of `split` (task types interleaved), optionally of some types, at most `limit`."""
    root = resolve_data_root(data)
    found = scan_split(root, split, task_types, limit)
    if found.corrupt:  # a damaged download: refuse rather than train on a silently smaller pool
        (path, why), n = found.corrupt[0], len(found.corrupt)
        raise UserError(f"corrupt game file {path}: {why}" + (f" (and {n - 1} more)" if n > 1 else "")
                        + f"; fix or remove it (`agentrl data check --data {root}` lists them all)")
    if not found.games:
        what = f" of type {', '.join(task_types)}" if task_types else ""
        raise UserError(f"no solvable games{what} in split {split!r} under {split_dir(root, split)}; {HOW_TO_GET}")
    return found.games
