"""Decoy visits in the walkthroughs (env/decoy.py, `sft.decoys N`).

Real games from ../shared played by the real engine: the decoy is a `go to` the walkthrough does
not make, to a place that shows other things and not the task's object, inserted before the
walkthrough's visit to where it takes the object; the new walkthrough wins, is the same for the
same seed, and its record is its replay; records are cached and prime sft's replay; the warm
start's data teaches every reply but the decoy's own (its mask), under the whole episode and
under prompt.history; the recipe names decoys only where used. The tiny model is a fixture's."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import pytest

from agentrl.config import load_config
from agentrl.env import AlfworldEnv
from agentrl.env.data import task_object
from agentrl.env.decoy import decoy_games, is_decoy, names_object, object_visit, play_decoys
from agentrl.env.pool import EnvPool, LocalEnvs
from agentrl.env.replay import ReplayCache, replay_game, replay_key
from agentrl.errors import UserError

THRESHOLD = 85.0


class NoEnvs:
    """A backend that must not be asked: everything comes from the caches."""

    workers = 1

    def submit(self, op, items):
        raise AssertionError(f"the backend was asked to {op}")


def test_the_object_visit_and_what_a_decoy_shows():
    walk = ["go to shelf 1", "go to drawer 2", "open drawer 2", "take pen 1 from drawer 2", "go to desk 1"]
    assert object_visit(walk, "pen") == 1  # the `go to` of the receptacle the object is taken from, an `open` between
    assert object_visit(walk, "pencil") is None and object_visit(["take pen 1 from desk 1"], "pen") is None
    assert names_object("On the desk 1, you see a pen 2, and a book 1.", "pen")
    assert not names_object("On the desk 1, you see a pencil 2.", "pen")
    assert is_decoy("You arrive at desk 1. On the desk 1, you see a pencil 2.", "pen")
    assert not is_decoy("You arrive at desk 1. On the desk 1, you see nothing.", "pen")  # nothing to take wrongly
    assert not is_decoy("You arrive at drawer 1. The drawer 1 is closed.", "pen")
    assert not is_decoy("You arrive at desk 1. On the desk 1, you see a Pen 3.", "pen")


@pytest.mark.parametrize("task_type", ["pick_and_place_simple", "pick_cool_then_place_in_recep"])
def test_a_decoy_is_a_place_without_the_object_before_the_walkthrough_goes_on(games, task_type):
    game = games[task_type]
    walk, obj = list(game.walkthrough), task_object(game)
    j = object_visit(walk, obj)
    record = play_decoys(AlfworldEnv, game, 1, seed=5, fuzzy_threshold=THRESHOLD)
    assert record.won and record.error is None
    commands = [s["command"] for s in record.steps]
    decoy = commands[j]
    assert decoy.startswith("go to ") and decoy not in walk[j:j + 1]
    assert commands[:j] + commands[j + 1:] == walk  # the walkthrough, the decoy inserted before its object visit
    assert is_decoy(record.steps[j]["observation"], obj)
    assert asdict(play_decoys(AlfworldEnv, game, 1, 5, THRESHOLD)) == asdict(record)  # the same seed, the same decoy
    taught = dataclasses.replace(game, walkthrough=tuple(commands))
    assert asdict(replay_game(AlfworldEnv, taught, THRESHOLD)) == asdict(record)  # the record is the replay
    assert asdict(play_decoys(AlfworldEnv, game, 0, 5, THRESHOLD)) == asdict(replay_game(AlfworldEnv, game, THRESHOLD))


def test_decoy_games_cache_the_play_prime_the_replay_and_name_the_untaught_steps(tmp_path, games):
    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    cache, replays = ReplayCache(tmp_path / "decoy"), ReplayCache(tmp_path / "replay")
    taught, skipped, stats = decoy_games(chosen, LocalEnvs(AlfworldEnv), cache, replays, 2, 0, THRESHOLD)
    assert not skipped and stats.games == 2 and stats.decoyed + stats.plain == 2 and stats.decoyed >= 1
    for g, t in zip(chosen, taught):
        if not t.untaught:
            assert t.walkthrough == g.walkthrough
            continue
        j = object_visit(list(g.walkthrough), task_object(g))
        assert t.untaught == tuple(range(j, j + len(t.untaught))) and 1 <= len(t.untaught) <= 2
        assert [c for i, c in enumerate(t.walkthrough) if i not in t.untaught] == list(g.walkthrough)
        assert stats.visits >= len(t.untaught)
        assert replays.get(replay_key(t, THRESHOLD)).won  # sft's replay reads the decoys' play
    again, _, again_stats = decoy_games(chosen, NoEnvs(), cache, replays, 2, 0, THRESHOLD)  # the cache: no env asked
    assert [(g.walkthrough, g.untaught) for g in again] == [(g.walkthrough, g.untaught) for g in taught]
    assert again_stats == stats
    with EnvPool(2) as pool:  # on the pool's workers: the same play
        pooled, _, _ = decoy_games(chosen, pool, None, None, 2, 0, THRESHOLD)
    assert [g.walkthrough for g in pooled] == [g.walkthrough for g in taught]


def test_decoys_are_checked_before_anything_runs():
    with pytest.raises(UserError, match="sft.decoys must be a whole number"):
        load_config(None, {"sft.decoys": -1})
    with pytest.raises(UserError, match="the handcoded expert searches on its own"):
        load_config(None, {"sft.decoys": 1, "sft.expert": "handcoded"})
    with pytest.raises(UserError, match="need env.kind alfworld"):
        load_config(None, {"sft.decoys": 1, "env.kind": "synthetic"})


@pytest.mark.parametrize("history", [0, 2])
def test_a_warm_start_with_decoys_teaches_every_reply_but_the_decoys(tmp_path, games, tokenizer, data_root, history):
    from agentrl.train.sft import expert_dataset, recipe, sft_prompt

    base = {"env.workers": 0, "data.root": str(data_root), "prompt.history": history or None}
    walk = sft_prompt(load_config(None, base))
    cfg = sft_prompt(load_config(None, base | {"sft.decoys": 1}))
    assert "decoys" not in recipe(walk) and recipe(cfg)["decoys"] == 1  # walkthrough warm starts keep their recipe

    game = games["pick_and_place_simple"]
    replays = ReplayCache(tmp_path / "replay")
    [taught], _, _ = decoy_games([game], LocalEnvs(AlfworldEnv), None, replays, 1, 0, THRESHOLD)
    assert taught.untaught
    plain = expert_dataset(walk, [game], tokenizer)
    decoyed = expert_dataset(cfg, [taught], tokenizer, replays=replays)

    def replies(data) -> list[str]:
        out = []
        for e in data.examples:
            ids = [t if m else None for t, m in zip(e.token_ids, e.action_mask)]
            runs, cur = [], []
            for t in ids + [None]:
                if t is None and cur:
                    runs.append(tokenizer.decode(cur).strip())
                    cur = []
                elif t is not None:
                    cur.append(t)
            out += runs
        return out

    # the same replies are taught, in the same order: the decoy's `go to` is played, not taught
    assert replies(decoyed) == replies(plain)
    decoy = taught.walkthrough[taught.untaught[0]]
    assert all(decoy not in r for r in replies(decoyed))
    text = "".join(tokenizer.decode(e.token_ids) for e in decoyed.examples)
    assert decoy in text  # ... and seen in the context of what follows it
    if history:
        assert len(decoyed.examples) == len(plain.examples)  # one example per taught reply


def test_a_warm_start_with_decoys_says_so(tmp_path, tiny_actor_dir, tokenizer, data_root):
    from transformers import AutoModelForCausalLM

    from agentrl.cli.display import sft_summary_lines
    from agentrl.train.sft import run_sft, sft_prompt

    cfg = sft_prompt(load_config(None, {
        "env.workers": 0, "learner.lora_r": 4, "learner.lora_alpha": 8, "learner.target_modules": ["q_proj"],
        "sft.games": 2, "sft.heldout_games": 1, "sft.epochs": 1, "model.name": str(tiny_actor_dir),
        "data.root": str(data_root), "sft.checkpoint_minutes": None, "sft.decoys": 1}))
    out = tmp_path / "ws"
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir)
    summary = run_sft(cfg, out, model=model, tokenizer=tokenizer, cache_dir=tmp_path / "cache")
    d = summary["sft"]["decoys"]
    assert d["games"] == 2 and d["decoyed"] + d["plain"] == 2 and d["visits"] == d["decoyed"]
    assert summary["recipe"]["decoys"] == 1 and (tmp_path / "decoy").is_dir()
    line = sft_summary_lines(summary, out)[0]
    assert f"{d['visits']} decoy visits in {d['decoyed']} of them ({d['plain']} as walked)" in line
