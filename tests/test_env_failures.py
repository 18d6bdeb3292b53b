"""A game the env cannot run is no outcome of the policy. Evals leave it out of the success rate
and its interval (and refuse, in one line, when nothing ran), training keeps its group out of the
loss and stops when every env failed, compare pairs only the games both sides played. Real
ALFWorld games; the broken one is a real game file with its PDDL problem cut short, written under
tmp_path (as tests/test_env.py does)."""

import json

import pytest

from agentrl.env.data import read_game
from agentrl.errors import RunError
from agentrl.rollout import WalkthroughPolicy, run_lockstep


def broken_game(tmp_path, good):
    data = json.loads(good.path.read_text())
    path = tmp_path / "look_at_obj_in_light-X-None-Y-1" / "trial_0" / "game.tw-pddl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data | {"pddl_problem": "(define (problem broken"}))
    return read_game(path, "valid_seen")


def test_eval_leaves_games_the_env_could_not_run_out_of_success(tmp_path, games):
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval, summary
    from agentrl.rollout.generator import Generator
    from agentrl.stats import wilson

    good, bad = games["look_at_obj_in_light"], broken_game(tmp_path, games["look_at_obj_in_light"])
    cfg = load_config(None, {"eval.policy": "walkthrough", "env.workers": 0})
    s = summary(run_eval(cfg, tmp_path / "e", [bad, good], Generator(cfg, walkthrough=True)), cfg)
    # before: 1 won of 2 episodes = 50%, the broken file counted as a lost game
    assert s["overall"]["episodes"] == 1 and s["overall"]["won"] == 1 and s["overall"]["success_rate"] == 1.0
    assert s["overall"]["env_errors"] == 1 and s["overall"]["ci95"] == pytest.approx(list(wilson(1, 1)))
    assert [e["task_id"] for e in s["errors"]] == [bad.game_id]

    from agentrl.compare import game_outcomes

    outcomes, _ = game_outcomes(tmp_path / "e")  # the episode row is kept for the record, not paired
    assert outcomes == {f"valid_seen/{good.game_id}": 1.0}

    with pytest.raises(RunError, match=r"the env failed on all 1 episodes, nothing was evaluated \(first: cannot load game .*ParseError"):
        run_eval(cfg, tmp_path / "f", [bad], Generator(cfg, walkthrough=True))
    assert not (tmp_path / "f" / "summary.json").exists()  # no 0% summary of an eval that never ran


def test_training_keeps_env_failed_groups_out_of_the_loss_and_stops_when_all_failed(tmp_path, games):
    from agentrl.train.advantage import batch_advantages
    from agentrl.train.loop import check_env_failures

    good = games["pick_and_place_simple"]
    bad = broken_game(tmp_path, games["look_at_obj_in_light"])
    rollout = run_lockstep([bad, good], WalkthroughPolicy(), max_steps=30, group_size=2)
    failed, ok = rollout.groups
    assert failed.env_failed and not ok.env_failed and failed.zero_variance  # all reward 0: as an all-fail group
    ok.trajectories[1].stop_reason = "lost"  # give the good group variance, so it has advantages to train
    batch = batch_advantages(rollout.groups)
    assert {id(t) for t, _ in batch} == {id(t) for t in ok.trajectories}

    warnings = []
    check_env_failures(3, rollout, warnings.append)
    assert len(warnings) == 1 and "the env failed on 2 trajectories; their 1 group(s) stay out of the loss" in warnings[0]

    only_bad = run_lockstep([bad], WalkthroughPolicy(), max_steps=30, group_size=2)
    with pytest.raises(RunError, match="the env failed on all 2 trajectories of iteration 4"):
        check_env_failures(4, only_bad, warnings.append)
    check_env_failures(5, run_lockstep([good], WalkthroughPolicy(), max_steps=30), warnings.append)
    assert len(warnings) == 1  # nothing failed: nothing said


def test_an_in_training_eval_on_which_every_env_failed_stops_the_run(tmp_path, games, tiny_model, tokenizer):
    """The eval of `agentrl train` (iteration 0 runs before any rollout): a real tiny model behind
    the hf sampler; the broken game fails at reset, before anything is generated."""
    from agentrl.config import load_config
    from agentrl.rollout.generator import Generator
    from agentrl.sampling.hf import HFSampler
    from agentrl.train.loop import evaluate

    bad = broken_game(tmp_path, games["look_at_obj_in_light"])
    cfg = load_config(None, {"env.workers": 0, "train.eval_max_steps": 2})
    generator = Generator(cfg, HFSampler(tiny_model, tokenizer))
    with pytest.raises(RunError, match="the env failed on all 1 held-out episodes of iteration 0, nothing was evaluated"):
        evaluate(cfg, generator, [bad], 0, 0)
    row = evaluate(cfg, generator, [bad, games["pick_and_place_simple"]], 1, 0)
    assert row["tasks"] == 1 and row["env_errors"] == 1 and list(row["outcomes"]) == [games["pick_and_place_simple"].game_id]
