"""ALFWorld's hand-coded expert as the warm start's teacher (env/expert.py, `sft.expert: handcoded`).

Real games from ../shared played by the real engine and alfworld's own expert: its play wins,
sends only admissible commands, is the same for the same seed, and is exactly what replaying its
commands gives (so its record can stand as that replay); records are cached by game file and
seed; a game the expert does not win is skipped with the reason; a warm start taught by it learns
the expert's commands, names its teacher in its recipe, and a walkthrough warm start's recipe is
what it was before the option. The tiny model is a fixture's."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import pytest

from agentrl.config import load_config
from agentrl.env import AlfworldEnv
from agentrl.env.expert import expert_games, play_handcoded, task_params
from agentrl.env.pool import EnvPool, LocalEnvs
from agentrl.env.replay import ReplayCache, replay_game, replay_key

THRESHOLD = 85.0


class NoEnvs:
    """A backend that must not be asked: everything comes from the caches."""

    workers = 1

    def submit(self, op, items):
        raise AssertionError(f"the backend was asked to {op}")


def test_the_task_is_read_from_the_task_directory(games):
    light, pick = games["look_at_obj_in_light"], games["pick_and_place_simple"]
    obj, _, lamp = light.path.parent.parent.name.split("-")[1:4]
    p = task_params(light)
    assert p["task_type"] == "look_at_obj_in_light" and p["parent_target"] == "" and p["mrecep_target"] == ""
    assert p["toggle_target"].lower() == lamp.lower() and p["object_target"].lower() == obj.lower()
    q = task_params(pick)
    assert q["toggle_target"] == "" and q["parent_target"].lower() == pick.path.parent.parent.name.split("-")[3].lower()


@pytest.mark.parametrize("task_type", ["pick_and_place_simple", "pick_heat_then_place_in_recep"])
def test_the_expert_wins_with_admissible_commands_and_its_play_is_its_replay(games, task_type):
    game = games[task_type]
    record = play_handcoded(game, 50, seed=3)
    assert record.won and record.error is None and record.steps[0]["command"] == "look"
    admissible = record.reset["admissible"]
    for s in record.steps:
        assert s["command"] in admissible
        admissible = s["admissible"]
    assert asdict(play_handcoded(game, 50, seed=3)) == asdict(record)  # the same seed, the same play
    taught = dataclasses.replace(game, walkthrough=[s["command"] for s in record.steps])
    assert asdict(replay_game(AlfworldEnv, taught, THRESHOLD)) == asdict(record)


def test_expert_games_cache_the_play_prime_the_replay_and_skip_what_the_expert_cannot_win(tmp_path, games):
    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    cache, replays = ReplayCache(tmp_path / "expert"), ReplayCache(tmp_path / "replay")
    taught, skipped = expert_games(chosen, LocalEnvs(AlfworldEnv), cache, replays, 50, 0, THRESHOLD)
    assert [g.game_id for g in taught] == [g.game_id for g in chosen] and not skipped
    for g, t in zip(chosen, taught):
        assert t.walkthrough[0] == "look" and tuple(t.walkthrough) != tuple(g.walkthrough)
        assert replays.get(replay_key(t, THRESHOLD)).steps[-1]["won"]  # sft's replay reads the expert's play
    again, _ = expert_games(chosen, NoEnvs(), cache, replays, 50, 0, THRESHOLD)  # from the cache: no env asked
    assert [g.walkthrough for g in again] == [g.walkthrough for g in taught]

    with EnvPool(2) as pool:  # on the pool's workers: the same play
        pooled, _ = expert_games(chosen, pool, None, None, 50, 0, THRESHOLD)
    assert [g.walkthrough for g in pooled] == [g.walkthrough for g in taught]

    short, skipped = expert_games(chosen[:1], LocalEnvs(AlfworldEnv), None, None, 2, 0, THRESHOLD)
    assert short == [] and skipped == [(chosen[0].game_id, "the hand-coded expert did not win within 2 steps")]


def test_a_warm_start_taught_by_the_expert_learns_its_commands_and_names_it(tmp_path, games, tiny_actor_dir,
                                                                           tokenizer, data_root):
    from transformers import AutoModelForCausalLM

    from agentrl.train.sft import expert_dataset, recipe, replay, run_sft, sft_prompt

    base = {"env.workers": 0, "learner.lora_r": 4, "learner.lora_alpha": 8, "learner.target_modules": ["q_proj"],
            "sft.games": 2, "sft.heldout_games": 1, "sft.epochs": 1, "model.name": str(tiny_actor_dir),
            "data.root": str(data_root), "sft.checkpoint_minutes": None}
    cfg = sft_prompt(load_config(None, base | {"sft.expert": "handcoded"}))
    walk = sft_prompt(load_config(None, base))
    assert "expert" not in recipe(walk)  # a walkthrough warm start keeps the recipe it had before the option
    assert recipe(cfg)["expert"] == {"name": "handcoded", "max_steps": 50}

    out = tmp_path / "ws"
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir)
    summary = run_sft(cfg, out, model=model, tokenizer=tokenizer, cache_dir=tmp_path / "cache")
    assert summary["sft"]["examples"] == 2 and summary["recipe"]["expert"]["name"] == "handcoded"
    assert summary["sft"]["expert"] == "handcoded"
    from agentrl.cli.display import sft_summary_lines

    assert "on the hand-coded expert's play of 2 games" in sft_summary_lines(summary, out)[0]
    assert (tmp_path / "expert").is_dir() and any((tmp_path / "expert").glob("*.json"))

    # the examples' replies are the expert's commands ("look" first), not the walkthrough's
    from agentrl.train.sft import SftHooks, select_games

    chosen = select_games(cfg, "train", 2)
    data, _ = replay(cfg, chosen, [], tokenizer, tmp_path / "cache", SftHooks())
    first = data.examples[0]
    replies = tokenizer.decode([t for t, m in zip(first.token_ids, first.action_mask) if m])
    assert "look" in replies.split("\n")[0] or replies.lstrip().startswith("Action: look")
    walk_data = expert_dataset(walk, chosen, tokenizer)
    assert [e.token_ids for e in walk_data.examples] != [e.token_ids for e in data.examples]
