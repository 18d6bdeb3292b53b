import json

import pytest

from agentrl.config import TASK_TYPES
from agentrl.env.data import discover_games, resolve_data_root, scan_split
from agentrl.errors import UserError


def test_discovers_every_valid_seen_game(data_root):
    games = discover_games("valid_seen", data_root)
    assert len(games) == 140
    assert {g.task_type for g in games} == set(TASK_TYPES)
    assert len({g.game_id for g in games}) == 140
    assert all(g.walkthrough for g in games)


def test_train_split_found_without_traj_data(data_root):
    games = discover_games("train", data_root, ["pick_heat_then_place_in_recep"])
    assert len(games) == 100
    assert all(g.task_type == "pick_heat_then_place_in_recep" and g.split == "train" for g in games)


def test_filters_and_limit_are_deterministic(data_root):
    first = discover_games("valid_unseen", data_root, ["look_at_obj_in_light", "pick_two_obj_and_place"], limit=5)
    again = discover_games("valid_unseen", data_root, ["look_at_obj_in_light", "pick_two_obj_and_place"], limit=5)
    assert [g.game_id for g in first] == [g.game_id for g in again]
    assert len(first) == 5 and {g.task_type for g in first} <= {"look_at_obj_in_light", "pick_two_obj_and_place"}


def test_first_games_cover_every_task_type(data_root):
    first = discover_games("valid_seen", data_root, limit=12)
    assert [g.task_type for g in first] == list(TASK_TYPES) * 2
    everything = discover_games("valid_seen", data_root)
    assert sorted(g.path for g in everything) == sorted(g.path for g in discover_games("valid_seen", data_root))
    same_type = [g.path for g in everything if g.task_type == "pick_and_place_simple"]
    assert same_type == sorted(same_type)


def test_data_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "env"))
    assert resolve_data_root(tmp_path / "flag") == tmp_path / "flag"
    assert resolve_data_root(None) == tmp_path / "env"
    monkeypatch.delenv("ALFWORLD_DATA")
    assert str(resolve_data_root(None)).endswith(".cache/alfworld")


def test_missing_data_dir_says_where_it_looked(tmp_path):
    with pytest.raises(UserError, match=r"no ALFWorld data at .*nowhere.*agentrl data download"):
        discover_games("valid_seen", tmp_path / "nowhere")


def test_missing_data_dir_names_the_script_that_unpacks_it(tmp_path):
    """A root with its unpacking script beside it (as ../shared/data/alfworld-full.sh beside
    alfworld-full): the one line names the script; without one it does not."""
    (tmp_path / "alfworld-full.sh").write_text("#!/bin/sh\n")
    with pytest.raises(UserError, match=r"no ALFWorld data at .*alfworld-full \(.*`bash .*alfworld-full\.sh` unpacks it"):
        discover_games("valid_seen", tmp_path / "alfworld-full")
    with pytest.raises(UserError) as e:
        discover_games("valid_seen", tmp_path / "alfworld")
    assert ".sh" not in str(e.value)


def test_missing_split_is_clear(tmp_path):
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(UserError, match=r"split 'valid_seen' not found"):
        discover_games("valid_seen", tmp_path)


def test_unknown_split_and_task_type(data_root):
    with pytest.raises(UserError, match="unknown split 'test'"):
        discover_games("test", data_root)
    with pytest.raises(UserError, match="unknown task type 'pick_heat'"):
        discover_games("valid_seen", data_root, ["pick_heat"])


def make_split(tmp_path, real_game, corrupt_text):
    """A data root holding one real game (symlinked, not copied) and one corrupt game file."""
    split = tmp_path / "json_2.1.1" / "valid_seen"
    good = split / real_game.path.parent.parent.name / real_game.path.parent.name
    good.mkdir(parents=True)
    (good / "game.tw-pddl").symlink_to(real_game.path)
    bad = split / "pick_and_place_simple-Broken-None-Shelf-1" / "trial_0"
    bad.mkdir(parents=True)
    (bad / "game.tw-pddl").write_text(corrupt_text)
    return bad / "game.tw-pddl"


def test_corrupt_game_file_is_refused_and_listed(tmp_path, games):
    bad = make_split(tmp_path, games["look_at_obj_in_light"], "{ this is not json")
    with pytest.raises(UserError, match=f"corrupt game file {bad}: unreadable JSON.*agentrl data check"):
        discover_games("valid_seen", tmp_path)
    scan = scan_split(tmp_path, "valid_seen")
    assert [p for p, _ in scan.corrupt] == [bad] and [g.task_type for g in scan.games] == ["look_at_obj_in_light"]


def test_unsolvable_games_are_filtered(tmp_path, games):
    data = json.loads(games["look_at_obj_in_light"].path.read_text())
    bad = make_split(tmp_path, games["look_at_obj_in_light"], json.dumps(data | {"solvable": False}))
    scan = scan_split(tmp_path, "valid_seen")
    assert len(scan.games) == 1 and scan.unsolvable == [bad]


def test_rollout_skip_tasks_takes_the_next_games_of_the_split(data_root):
    """`agentrl rollout --skip-tasks N`: tasks disjoint from an earlier rollout of the first N."""
    from agentrl.collect import load_games
    from agentrl.config import load_config

    first = load_games(load_config(None, {"rollout.split": "valid_seen", "rollout.tasks": 5}))
    later = load_games(load_config(None, {"rollout.split": "valid_seen", "rollout.tasks": 2, "rollout.skip_tasks": 3}))
    assert [g.game_id for g in later] == [g.game_id for g in first[3:]]


def test_valid_train_is_a_split_where_the_data_has_it(tmp_path, games):
    """The full data's held-out train trials (json_2.1.1/valid_train, for choosing checkpoints) load as
    the split `valid_train`; a root without it names the split it lacks."""
    from agentrl.config import load_config

    make_split(tmp_path / "small", games["look_at_obj_in_light"], "{}")
    with pytest.raises(UserError, match=r"split 'valid_train' not found"):
        discover_games("valid_train", tmp_path / "small")
    split = tmp_path / "full" / "json_2.1.1" / "valid_train"
    for g in games.values():
        d = split / g.path.parent.parent.name / g.path.parent.name
        d.mkdir(parents=True)
        (d / "game.tw-pddl").symlink_to(g.path)
    found = discover_games("valid_train", tmp_path / "full")
    assert {g.task_type for g in found} == set(TASK_TYPES) and all(g.split == "valid_train" for g in found)
    assert all(g.walkthrough for g in found)
    for key in ("eval.split", "rollout.split", "train.eval_split"):
        assert load_config(None, {key: "valid_train"})  # accepted where a split is chosen


def test_synthetic_valid_train_tasks_are_their_own():
    from agentrl.env.synthetic import SPLIT_OFFSET

    assert len(set(SPLIT_OFFSET.values())) == len(SPLIT_OFFSET) and "valid_train" in SPLIT_OFFSET
