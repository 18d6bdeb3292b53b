"""Walkthrough replay (env/replay.py): on the env pool's workers it gives the serial replay's
examples in the serial order; the records are cached by game file, so a second replay opens no
env; a damaged cache file is rebuilt; an unwinnable walkthrough is recorded and skipped with a
count; the cache travels as one file (`agentrl data replay --export / --import`). Real games
from ../shared; the constructed game lives in tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from agentrl.config import load_config
from agentrl.env import AlfworldEnv, EnvsOnDemand, prompt_options
from agentrl.env.data import read_game
from agentrl.env.pool import EnvPool, LocalEnvs
from agentrl.env.replay import ReplayCache, export_replays, import_replays, replay_key, replay_walkthroughs
from agentrl.errors import UserError
from agentrl.train.sft import expert_dataset, sft_prompt

THRESHOLD = 85.0


def sft_cfg(**overrides):
    return sft_prompt(load_config(None, {"env.workers": 0} | overrides))


class Counting:
    """make_env of real envs, counting how many were opened."""

    def __init__(self):
        self.opened = 0

    def __call__(self, game):
        self.opened += 1
        return AlfworldEnv(game)


def chosen_games(games):
    return [games["pick_and_place_simple"], games["look_at_obj_in_light"], games["pick_clean_then_place_in_recep"]]


def unwinnable_game(games, tmp_path):
    """A real game whose walkthrough stops one command short of the win, as a file of its own."""
    src = games["look_at_obj_in_light"].path
    data = json.loads(src.read_text())
    data["walkthrough"] = data["walkthrough"][:-1]
    f = tmp_path / "json_2.1.1" / "valid_seen" / src.parent.parent.name / "trial_short" / "game.tw-pddl"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(data))
    return read_game(f, "valid_seen")


def test_the_pool_replays_give_the_serial_examples_in_the_serial_order(tmp_path, games, tokenizer):
    """Today's serial replay (the policy driven through the real engine in this process, one
    lockstep run) against the new path (walkthroughs on 2 pool workers, examples rebuilt from the
    records): the same examples, token for token, in the same order; the pool's records equal
    the in-process ones (with prompt.admissible on: the admissible lists, in their order, too)."""
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.rollout.trajectory import step_sequences
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    cfg = sft_cfg(**{"prompt.admissible": True})
    chosen = chosen_games(games)
    sampler = ExpertSampler(tokenizer, {g.game_id: tuple(g.walkthrough) for g in chosen}, "action")
    policy = ModelPolicy(sampler, SamplingParams(0.0, 1.0, 10_000), seed=0, **prompt_options(cfg))
    serial = run_lockstep(chosen, policy, max_steps=max(len(g.walkthrough) for g in chosen) + 1,
                          fuzzy_threshold=cfg.env.fuzzy_threshold)
    expected = [(t.game.game_id, ids, mask) for t in serial.trajectories if t.won for ids, mask, _ in step_sequences(t, 0)]
    assert len(expected) == len(chosen)

    with EnvPool(2) as pool:
        data = expert_dataset(cfg, chosen, tokenizer, envs=pool, replays=ReplayCache(tmp_path / "replay"))
    assert [(e.game_id, e.token_ids, e.action_mask) for e in data.examples] == expected
    assert not data.skipped and data.replay.replayed == len(chosen) and data.replay.hits == 0

    in_process, _ = replay_walkthroughs(chosen, LocalEnvs(AlfworldEnv), None, THRESHOLD)
    with EnvPool(2) as pool:
        pooled, stats = replay_walkthroughs(chosen, pool, None, THRESHOLD)
    assert list(pooled) == [g.game_id for g in chosen] and stats.won == len(chosen)
    assert [asdict(r) for r in pooled.values()] == [asdict(r) for r in in_process.values()]


def test_a_second_replay_reads_the_cache_and_opens_no_env(tmp_path, games, tokenizer):
    """The records are the env's facts, not tokens: a second warm start with another prompt
    (a new dataset key) still replays nothing."""
    chosen = chosen_games(games)
    cache, make_env = ReplayCache(tmp_path / "replay"), Counting()
    first = expert_dataset(sft_cfg(), chosen, tokenizer, envs=LocalEnvs(make_env), cache_dir=tmp_path / "sft", replays=cache)
    assert make_env.opened == len(chosen) and first.replay.replayed == len(chosen)
    assert len(list(cache.root.glob("*.json"))) == len(chosen)

    second = expert_dataset(sft_cfg(**{"prompt.history": 1}), chosen, tokenizer, envs=LocalEnvs(make_env),
                            cache_dir=tmp_path / "sft", replays=cache)
    assert make_env.opened == len(chosen)  # no env opened the second time

    cfg = sft_cfg(**{"prompt.history": 2, "env.workers": 2})
    pool = EnvsOnDemand(cfg)  # what the warm start opens: no worker starts when every game is cached
    third = expert_dataset(cfg, chosen, tokenizer, envs=pool, replays=cache)
    assert pool.opened is None and third.replay.hits == len(chosen) and len(third.examples) == len(second.examples)
    assert (second.replay.hits, second.replay.replayed) == (len(chosen), 0) and not second.cached
    assert len(second.examples) == sum(len(g.walkthrough) for g in chosen)  # history 1: one example per step
    assert not second.skipped


def test_a_damaged_cache_file_is_rebuilt(tmp_path, games):
    chosen = chosen_games(games)[:2]
    cache, make_env = ReplayCache(tmp_path / "replay"), Counting()
    records, _ = replay_walkthroughs(chosen, LocalEnvs(make_env), cache, THRESHOLD)
    damaged = cache.path(replay_key(chosen[1], THRESHOLD))
    good = damaged.read_text()
    damaged.write_text(good[: len(good) // 2])  # a cut-short file (no write of ours leaves one: tmp + rename)

    again, stats = replay_walkthroughs(chosen, LocalEnvs(make_env), cache, THRESHOLD)
    assert (stats.hits, stats.corrupt, stats.replayed) == (1, 1, 1) and make_env.opened == 3
    assert damaged.read_text() == good
    assert [asdict(r) for r in again.values()] == [asdict(r) for r in records.values()]
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_an_unwinnable_walkthrough_is_recorded_and_skipped_with_a_count(tmp_path, games, tokenizer):
    good, short = games["pick_and_place_simple"], unwinnable_game(games, tmp_path)
    cache, make_env = ReplayCache(tmp_path / "replay"), Counting()
    records, stats = replay_walkthroughs([good, short], LocalEnvs(make_env), cache, THRESHOLD)
    assert (stats.won, stats.unwinnable, stats.failed) == (1, 1, 0)
    assert not records[short.game_id].won and len(records[short.game_id].steps) == len(short.walkthrough)
    assert cache.path(replay_key(short, THRESHOLD)).is_file()  # deterministic: kept, as a loss

    data = expert_dataset(sft_cfg(), [good, short], tokenizer, envs=LocalEnvs(make_env), replays=cache)
    assert make_env.opened == 2 and data.replay.hits == 2 and data.replay.unwinnable == 1
    assert [e.game_id for e in data.examples] == [good.game_id]
    assert [g for g, _ in data.skipped] == [short.game_id] and "did not win" in data.skipped[0][1]


def test_the_cache_travels_as_one_file(tmp_path, games):
    chosen = chosen_games(games)[:2]
    here = ReplayCache(tmp_path / "here")
    records, _ = replay_walkthroughs(chosen, LocalEnvs(AlfworldEnv), here, THRESHOLD)
    carried = tmp_path / "replays.jsonl.xz"
    assert export_replays(here, chosen, THRESHOLD, carried) == 2

    there = ReplayCache(tmp_path / "there")
    assert import_replays(there, carried) == 2

    def no_env(game):
        raise AssertionError("opened an env on the machine the cache was carried to")

    again, stats = replay_walkthroughs(chosen, LocalEnvs(no_env), there, THRESHOLD)
    assert stats.hits == 2 and [asdict(r) for r in again.values()] == [asdict(r) for r in records.values()]

    import lzma

    bad = tmp_path / "bad.jsonl.xz"
    with lzma.open(bad, "wt") as f:
        f.write(json.dumps({"key": "../../escape", "record": {}}) + "\n")
    with pytest.raises(UserError, match="bad.jsonl.xz:1: not a replay record"):
        import_replays(there, bad)
    with pytest.raises(UserError, match="cannot read"):
        import_replays(there, tmp_path / "missing.xz")


def test_data_replay_fills_the_cache_and_says_what_it_did(tmp_path, data_root):
    def agentrl(*args):
        return subprocess.run([sys.executable, "-m", "agentrl.cli", "data", "replay", "--data", str(data_root),
                               "--split", "valid_seen", "--games", "2", *args], capture_output=True, text=True,
                              env=os.environ | {"AGENTRL_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}, timeout=300)

    first = agentrl("--env-workers", "0")
    assert first.returncode == 0, first.stderr
    assert "2 valid_seen walkthroughs: 0 from the cache, 2 replayed (in this process)" in first.stdout
    assert "2 won, 0 unwinnable, 0 failed" in first.stdout
    second = agentrl("--env-workers", "0", "--export", str(tmp_path / "r.jsonl.xz"))
    assert "2 from the cache, 0 replayed (no env opened)" in second.stdout and "wrote 2 replays to" in second.stdout
    (tmp_path / "bad.xz").write_text("not xz")
    bad = agentrl("--import", str(tmp_path / "bad.xz"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "cannot read" in bad.stderr


def test_how_many_games_are_playable_is_said_where_a_user_looks(tmp_path, games):
    """A data root of three train games, one of them a real game whose walkthrough was cut short
    (it cannot win): `agentrl data replay` counts and names it, `agentrl data check` then says how
    many are playable, and `agentrl eval --policy walkthrough` says the same from the engine."""
    root = tmp_path / "data"
    short = unwinnable_game(games, tmp_path / "short")
    for game in (games["pick_and_place_simple"], games["look_at_obj_in_light"], short):
        f = root / "json_2.1.1" / "train" / game.path.parent.parent.name / game.path.parent.name / "game.tw-pddl"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(game.path.read_bytes())
    env = os.environ | {"AGENTRL_CACHE": str(tmp_path / "cache"), "COLUMNS": "250"}

    def agentrl(*args):
        out = subprocess.run([sys.executable, "-m", "agentrl.cli", *args, "--data", str(root)], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    before = agentrl("data", "check")
    assert "train: 0 playable (their walkthrough wins), 0 whose walkthrough does not win (agentrl sft skips them), " \
           "3 not replayed yet (`agentrl data replay --split train` replays them)" in before
    replayed = agentrl("data", "replay", "--split", "train", "--env-workers", "0")
    assert "2 won, 1 unwinnable, 0 failed" in replayed
    assert "playable: 2 of 3; 1 whose walkthrough does not win are skipped by agentrl sft" in replayed
    assert f"does not win {short.game_id}" in replayed
    after = agentrl("data", "check")
    assert "train: 2 playable (their walkthrough wins), 1 whose walkthrough does not win (agentrl sft skips them), " \
           "0 not replayed yet" in after
    played = agentrl("eval", "--split", "train", "--policy", "walkthrough", "--env-workers", "0",
                     "--out", str(tmp_path / "eval"))
    assert "playable: 2 of 3 walkthroughs win; 1 do not (agentrl sft skips them, counted)" in played
    assert f"does not win: {short.game_id}" in played
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["walkthroughs"] == {"won": 2, "unwinnable": [short.game_id], "longer_than_t_max": []}


def test_a_game_that_hangs_again_takes_no_other_with_it_on_the_second_try(games):
    """The second try sends one request a worker at a time: a game that hangs again (a planner
    state past the timeout) is the only one lost. A stand-in backend, because a real worker cannot
    be made to hang on one chosen game every time: like EnvPool's, its worker loses every request
    in flight when one of them hangs."""
    from agentrl.env.pool import EnvFailure, Pending
    from agentrl.env.replay import Replay, ReplayStats, played

    chosen = list(games.values())  # six games, one request each: four in flight at first
    hangs = chosen[2].game_id

    class OneWorker:
        workers = 1

        def __init__(self):
            self.in_flight: list[Pending] = []

        def submit(self, op, items):
            p = Pending(op, [g for _, g in items])
            self.in_flight.append(p)
            return p

        def collect(self, pending):
            if pending not in self.in_flight:  # lost with an earlier hang
                return pending.out
            if any(g.game_id == hangs for p in self.in_flight for g in p.out):  # the worker hangs: all in flight lost
                lost, self.in_flight = self.in_flight, []
                for p in lost:
                    p.out = [EnvFailure("env worker did not answer", worker_lost=True)] * len(p.out)
                return pending.out
            self.in_flight.remove(pending)
            pending.out = [Replay(g.game_id, won=True) for g in pending.out]
            return pending.out

    records, stats = played(chosen, OneWorker(), None, "replay", lambda g: None, lambda g: g)
    assert isinstance(stats, ReplayStats)
    assert [g.game_id for g in chosen if records[g.game_id].error] == [hangs]  # only the game that hangs
    assert stats.retried == 4  # the first try lost the four in flight with it


def test_games_lost_with_a_hung_worker_are_played_once_more(tmp_path, games, caplog):
    """A worker that hangs (SIGSTOP) loses every game queued on it: those are played once more on
    the fresh worker, not skipped (a warm start would otherwise train on fewer games for a
    transient hang), said in one line, and cached like any other; the records equal the
    in-process replay's. The pool's only change for the test: the fresh worker gets the usual
    timeout back (a cold worker can take seconds to start)."""
    import logging
    import signal

    class Pool(EnvPool):
        def _replace(self, w):
            super()._replace(w)
            self.timeout_s = 120.0

    chosen = chosen_games(games)[:2]
    in_process, _ = replay_walkthroughs(chosen, LocalEnvs(AlfworldEnv), None, THRESHOLD)
    with Pool(workers=1, timeout_s=120.0) as pool:
        pool.reset_all([(0, chosen[0])])  # a warm worker
        pool.release([0])
        pool.timeout_s = 2.0
        os.kill(pool.pids[0], signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="agentrl.env.replay"):
            records, stats = replay_walkthroughs(chosen, pool, ReplayCache(tmp_path / "replay"), THRESHOLD)
        assert pool.replaced == 1
    assert stats.retried == 2 and stats.won == 2 and stats.failed == 0 and stats.replayed == 2
    assert [asdict(r) for r in records.values()] == [asdict(r) for r in in_process.values()]
    assert "2 games lost with an env worker that hung or died during replay: played once more" in caplog.text
    _, again = replay_walkthroughs(chosen, LocalEnvs(AlfworldEnv), ReplayCache(tmp_path / "replay"), THRESHOLD)
    assert again.hits == 2
