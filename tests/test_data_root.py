"""Which data `make train` reads, and which games its warm start learns from.

`make train` and `make bench` read every train game (../shared/data/alfworld-full.sh unpacks them
and prints their root) unless ALFWORLD_DATA is set; `make test` never does. The warm start's 120
games are the same from the 600-game root and from the full one (`sft.spread 100`, the rule the
600 were drawn by); checked on the real full root where it has been unpacked, skipped elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.env.data import discover_games, round_robin, spread
from agentrl.train.sft import select_games

REPO = Path(__file__).resolve().parents[1]


def make_n(tmp_path: Path, target: str, **env) -> str:
    """`make -n TARGET` (print, run nothing) of this Makefile in a checkout beside a shared/ that
    holds the full data's script (an empty stand-in: -n runs nothing)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        repo.mkdir()
        shutil.copy(REPO / "Makefile", repo / "Makefile")
        (repo / "pyproject.toml").touch()
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / ".agentrl-installed").touch()  # set-up done: the stamp is newer than pyproject.toml
        script = tmp_path / "shared" / "data" / "alfworld-full.sh"
        script.parent.mkdir(parents=True)
        script.write_text("#!/bin/sh\n")
    base = {k: v for k, v in os.environ.items() if k not in ("ALFWORLD_DATA", "MAKEFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", target], cwd=repo, env=base | env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_train_reads_every_train_game_unless_alfworld_data_is_set(tmp_path):
    script = str(tmp_path / "shared" / "data" / "alfworld-full.sh")
    train = make_n(tmp_path, "train")
    assert f"root=$(bash {script}) && export ALFWORLD_DATA=$root" in train
    assert train.index("alfworld-full.sh") < train.index("agentrl sft") < train.index("agentrl train")
    assert script in make_n(tmp_path, "bench")
    assert "alfworld-full" not in make_n(tmp_path, "train", ALFWORLD_DATA="/my/data")  # the user's data wins
    assert "alfworld-full" not in make_n(tmp_path, "test")  # tests and CI keep the small set
    os.remove(script)
    assert "alfworld-full" not in make_n(tmp_path, "train")  # no script: the shared 600-game copy


def test_spread_keeps_the_small_roots_games_and_unset_games_take_all(data_root):
    games = discover_games("train", data_root)
    assert len(spread(games, 100)) == len(games) == 600  # 100 per type there: the rule keeps them all
    assert [g.game_id for g in round_robin(spread(games, 100), 120)] == [g.game_id for g in round_robin(games, 120)]
    assert len(round_robin(games, None)) == len(games)  # sft.games unset: every game
    assert [len([g for g in spread(games, 7) if g.task_type == t]) for t in {g.task_type for g in games}] == [7] * 6


def full_root(data_root: Path) -> Path | None:
    """Where ../shared/data/alfworld-full.sh unpacked every train game, if it has."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl" / "alfworld-full"
    for root in (data_root.parent / "alfworld-full", cache):
        if (root / ".complete").is_file() and (root / "json_2.1.1" / "train").is_dir():
            return root
    return None


def test_make_trains_120_games_are_the_same_from_the_full_root(data_root):
    full = full_root(data_root)
    if full is None:
        pytest.skip("every train game is not unpacked here (../shared/data/alfworld-full.sh does it)")
    cfg = load_config(REPO / "configs" / "default.yaml")
    small = [g.game_id for g in select_games(load_config(REPO / "configs" / "default.yaml", {"data.root": str(data_root)}),
                                             "train", cfg.sft.games)]
    every = [g.game_id for g in select_games(load_config(REPO / "configs" / "default.yaml", {"data.root": str(full)}),
                                             "train", cfg.sft.games)]
    assert len(small) == 120 and every == small
    assert len(discover_games("train", full)) == 3553
    # and the rule is what made the 600: drawn from every train game, they are the small root's
    assert {g.game_id for g in spread(discover_games("train", full), 100)} == {g.game_id for g in discover_games("train", data_root)}
    unspread = round_robin(discover_games("train", full), 120)
    assert [g.game_id for g in unspread] != small  # without the rule the first 120 would be other games
