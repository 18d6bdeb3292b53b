#!/usr/bin/env python
"""Build (or check) the in-context ReAct examples in prompts/examples/ from real ALFWorld games.

Generate skeletons (one per task type, Thought lines left as "Thought: TODO"):

    python scripts/make_examples.py [--data $ALFWORLD_DATA] [--out prompts/examples] [--force]

For each of the six task types, the first TRAIN game in sorted path order is taken whose
walkthrough has at most --max-steps commands and is coherent (every take/move/open/heat/...
happens at the receptacle the agent last went to, and every object taken was seen there),
whose first observation lists at most --max-receptacles receptacles, and whose skeleton
transcript has at most --max-chars characters (if no game passes the size limits, the
shortest coherent skeleton). The game's own `walkthrough` is replayed in the real engine
and must end with won == True (and every command must be admissible when it is issued).

The Thought lines are then written by hand. An example file whose Thought lines are
already filled in is never overwritten unless --force is given.

Check finished examples (every Action replays to a win, every Observation matches the
engine's feedback exactly, every Thought is filled in):

    python scripts/make_examples.py --check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from agentrl.config import TASK_TYPES

REPO = Path(__file__).resolve().parents[1]
TODO = "Thought: TODO"
_WELCOME = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_NEWLINES = re.compile(r"\s*\n\s*")


class ExampleError(RuntimeError):
    pass


def one_line(text: str) -> str:
    """Engine text as one transcript line: header stripped, newlines (and the spaces around them) -> one space."""
    return _NEWLINES.sub(" ", _WELCOME.sub("", text or "").strip())


def count_receptacles(first_obs: str) -> int:
    """Items in the 'Looking quickly around you, you see a X, a Y, and a Z.' list of the first observation."""
    match = re.search(r"you see (.*?)\.", first_obs)
    return len(re.split(r",\s*(?:and\s+)?|\s+and\s+", match.group(1))) if match else 0


class Game:
    """One game.tw-pddl in the real engine, with alfworld's own wrappers."""

    def __init__(self, path: Path):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        infos = textworld.EnvInfos(won=True, admissible_commands=True)
        self._env = textworld.start(str(path), request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        self.admissible: list[str] = []

    def reset(self) -> str:
        state = self._env.reset()
        self.admissible = list(state["admissible_commands"] or [])
        return one_line(state.feedback)

    def step(self, command: str) -> tuple[str, bool]:
        state, _reward, _done = self._env.step(command)
        self.admissible = list(state["admissible_commands"] or [])
        return one_line(state.feedback), bool(state["won"])

    def close(self) -> None:
        self._env.close()


@dataclass
class Replay:
    source: str  # train/<task dir>/<trial>
    first: str
    steps: list[tuple[str, str]]  # (command, feedback)

    def skeleton(self) -> str:
        lines = [f"# source: {self.source}", f"Observation: {self.first}"]
        for command, feedback in self.steps:
            lines += [TODO, f"Action: {command}", f"Observation: {feedback}"]
        return "\n".join(lines) + "\n"


def replay_walkthrough(path: Path, data: Path) -> Replay:
    walkthrough = json.loads(path.read_text())["walkthrough"]
    game = Game(path)
    try:
        first = game.reset()
        steps, won = [], False
        for i, command in enumerate(walkthrough):
            if won:
                raise ExampleError(f"{path}: won before walkthrough step {i + 1}")
            if command not in game.admissible:
                raise ExampleError(f"{path}: walkthrough step {i + 1} {command!r} is not admissible")
            feedback, won = game.step(command)
            steps.append((command, feedback))
    finally:
        game.close()
    if not won:
        raise ExampleError(f"{path}: the walkthrough does not end with won == True")
    source = path.parent.relative_to(data / "json_2.1.1").as_posix()
    return Replay(source, first, steps)


def coherent(replay: Replay) -> bool:
    """True if the walkthrough reads like a plausible agent's: every command that names a receptacle
    is issued at that receptacle (the last `go to`), and every object taken or used was seen there.
    (Some ALFRED walkthroughs take an object from a receptacle that shares a spot with the one the
    agent went to; they make poor examples, since the object never appears in an observation.)"""
    here, seen = None, ""

    def visible(name: str) -> bool:
        return re.search(rf"\b{re.escape(name)}\b", seen) is not None

    for command, feedback in replay.steps:
        if m := re.fullmatch(r"go to (.+)", command):
            here, seen = m.group(1), feedback
            continue
        if m := re.fullmatch(r"take (.+) from (.+)", command):
            ok = m.group(2) == here and visible(m.group(1))
        elif m := re.fullmatch(r"(?:heat|cool|clean) .+ with (.+)", command):
            ok = m.group(1) == here
        elif m := re.fullmatch(r"move .+ to (.+)", command):
            ok = m.group(1) == here
        elif m := re.fullmatch(r"(?:open|close) (.+)", command):
            ok = m.group(1) == here
        elif m := re.fullmatch(r"use (.+)", command):
            ok = visible(m.group(1))
        else:
            ok = True
        if not ok:
            return False
        seen += " " + feedback
    return True


def train_games(data: Path, task_type: str) -> list[Path]:
    root = data / "json_2.1.1" / "train"
    return sorted(p for p in root.glob("*/*/game.tw-pddl") if p.parent.parent.name.split("-", 1)[0] == task_type)


def pick_example(data: Path, task_type: str, args: argparse.Namespace) -> Replay:
    paths = [p for p in train_games(data, task_type) if len(json.loads(p.read_text())["walkthrough"]) <= args.max_steps]
    if not paths:
        raise ExampleError(f"no train game of type {task_type} with at most {args.max_steps} steps under {data}")
    replays = []
    for path in paths:
        replay = replay_walkthrough(path, data)
        if not coherent(replay):
            continue
        if count_receptacles(replay.first) <= args.max_receptacles and len(replay.skeleton()) <= args.max_chars:
            return replay
        replays.append(replay)
    if not replays:
        raise ExampleError(f"no coherent {task_type} walkthrough with at most {args.max_steps} steps under {data}")
    print(f"warning: no {task_type} game passes the size limits; taking the shortest", file=sys.stderr)
    return min(replays, key=lambda r: len(r.skeleton()))  # min() keeps the first (path order) on ties


def thoughts_filled(path: Path) -> bool:
    return any(line.startswith("Thought:") and line.strip() != TODO for line in path.read_text().splitlines())


def generate(args: argparse.Namespace) -> int:
    types = args.types or list(TASK_TYPES)
    targets = {t: args.out / f"{t}.txt" for t in types}
    filled = [str(p) for p in targets.values() if p.exists() and thoughts_filled(p)]
    if filled and not args.force:
        print("refusing to overwrite example files whose Thought lines are filled in (use --force):", file=sys.stderr)
        for p in filled:
            print(f"  {p}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for task_type, target in targets.items():
        replay = pick_example(args.data, task_type, args)
        text = replay.skeleton()
        target.write_text(text)
        print(f"{task_type}: {replay.source} ({len(replay.steps)} steps, {len(text)} chars) -> {target}")
    return 0


def parse_example(text: str, name: str) -> tuple[str, str, list[tuple[str, str, str]]]:
    """(source, first observation, [(thought, action, observation)]) of an example file; raises on bad format."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) < 5 or (len(lines) - 2) % 3:
        raise ExampleError(f"{name}: expected '# source:', Observation, then Thought/Action/Observation triples")
    if not lines[0].startswith("# source: "):
        raise ExampleError(f"{name}: line 1 must be '# source: train/<task dir>/<trial>'")

    def field(i: int, key: str) -> str:
        prefix = f"{key}: "
        if not lines[i].startswith(prefix) or not lines[i][len(prefix):].strip():
            raise ExampleError(f"{name}: line {i + 1} must be '{prefix}<text>', got {lines[i]!r}")
        return lines[i][len(prefix):]

    triples = [(field(i, "Thought"), field(i + 1, "Action"), field(i + 2, "Observation")) for i in range(2, len(lines), 3)]
    return lines[0][len("# source: "):].strip(), field(1, "Observation"), triples


def check_file(path: Path, data: Path) -> list[str]:
    """Problems with one example file (empty list: it passes)."""
    task_type = path.stem
    try:
        source, first, triples = parse_example(path.read_text(), path.name)
    except ExampleError as e:
        return [str(e)]
    problems = []
    task_dir = source.split("/")[1] if source.count("/") == 2 else ""
    if not source.startswith("train/") or task_dir.split("-", 1)[0] != task_type:
        problems.append(f"source {source!r} is not a train game of type {task_type}")
    game_file = data / "json_2.1.1" / source / "game.tw-pddl"
    if not game_file.is_file():
        return problems + [f"game file not found: {game_file}"]
    for i, (thought, _, _) in enumerate(triples, 1):
        if thought.strip() == "TODO":
            problems.append(f"step {i}: Thought is still TODO")
    game = Game(game_file)
    try:
        got = game.reset()
        if got != first:
            problems.append(f"first Observation differs from the engine:\n    file:   {first!r}\n    engine: {got!r}")
        won = False
        for i, (_, action, observation) in enumerate(triples, 1):
            if won:
                problems.append(f"step {i}: the game was already won after step {i - 1}")
                break
            if action not in game.admissible:
                problems.append(f"step {i}: Action {action!r} is not admissible")
                break
            got, won = game.step(action)
            if got != observation:
                problems.append(f"step {i}: Observation differs from the engine:\n    file:   {observation!r}\n    engine: {got!r}")
        if not won and not problems:
            problems.append("the Actions do not end with won == True")
    finally:
        game.close()
    return problems


def check(args: argparse.Namespace) -> int:
    types = args.types or list(TASK_TYPES)
    failed = 0
    for task_type in types:
        path = args.out / f"{task_type}.txt"
        if not path.exists():
            print(f"FAIL {path}: missing")
            failed += 1
            continue
        problems = check_file(path, args.data)
        text = path.read_text()
        n_steps = sum(line.startswith("Action: ") for line in text.splitlines())
        if problems:
            failed += 1
            print(f"FAIL {path}")
            for p in problems:
                print(f"  {p}")
        else:
            source = text.splitlines()[0][len("# source: "):]
            print(f"ok   {path}: {source}, {n_steps} steps, won, {len(text)} chars")
    print(f"{len(types) - failed}/{len(types)} example files pass")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("ALFWORLD_DATA") or "/work/shared/data/alfworld"),
                    help="ALFWorld data folder holding json_2.1.1/ (default: $ALFWORLD_DATA or /work/shared/data/alfworld)")
    ap.add_argument("--out", type=Path, default=REPO / "prompts" / "examples",
                    help="example folder (default: prompts/examples in this repository)")
    ap.add_argument("--check", action="store_true", help="check the existing example files instead of writing skeletons")
    ap.add_argument("--force", action="store_true", help="overwrite example files whose Thought lines are filled in")
    ap.add_argument("--types", nargs="+", choices=TASK_TYPES, help="only these task types (default: all six)")
    ap.add_argument("--max-steps", type=int, default=12, help="longest walkthrough to accept (default 12)")
    ap.add_argument("--max-receptacles", type=int, default=20,
                    help="most receptacles listed in the first observation (default 20)")
    ap.add_argument("--max-chars", type=int, default=1500, help="longest skeleton transcript to accept (default 1500)")
    args = ap.parse_args(argv)
    if not (args.data / "json_2.1.1").is_dir():
        print(f"error: {args.data}/json_2.1.1 not found (set --data or ALFWORLD_DATA)", file=sys.stderr)
        return 2
    try:
        return check(args) if args.check else generate(args)
    except ExampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
