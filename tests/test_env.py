import json

from agentrl.env.alfworld import NOTHING_HAPPENS, AlfworldEnv
from agentrl.env.data import read_game
from agentrl.rollout import WalkthroughPolicy, run_lockstep


def test_reset_gives_task_and_admissible_commands(games):
    env = AlfworldEnv(games["pick_and_place_simple"])
    first = env.reset()
    assert "Your task is to:" in first.observation and not first.observation.startswith("-=")
    assert any(c.startswith("go to ") for c in first.admissible)
    assert not first.won and not first.done
    env.close()


def test_invalid_action_is_a_noop(games):
    env = AlfworldEnv(games["pick_and_place_simple"])
    first = env.reset()
    res = env.step(None)
    assert res.observation == NOTHING_HAPPENS and res.admissible == first.admissible and not res.done
    res = env.step("fly to the moon")  # not admissible: never reaches the engine
    assert res.observation == NOTHING_HAPPENS and res.admissible == first.admissible
    env.close()


def test_walkthrough_wins_and_reset_restarts(games):
    game = games["pick_clean_then_place_in_recep"]
    env = AlfworldEnv(game)
    env.reset()
    for i, command in enumerate(game.walkthrough):
        res = env.step(command)
        assert res.won == (i == len(game.walkthrough) - 1)
    assert res.done
    again = env.reset()
    assert not again.won and "Your task is to:" in again.observation
    env.close()


def test_corrupt_game_marks_only_its_trajectory(tmp_path, games):
    good = games["look_at_obj_in_light"]
    data = json.loads(good.path.read_text())
    broken = tmp_path / "look_at_obj_in_light-X-None-Y-1" / "trial_0" / "game.tw-pddl"
    broken.parent.mkdir(parents=True)
    broken.write_text(json.dumps(data | {"pddl_problem": "(define (problem broken"}))
    bad_game = read_game(broken, "valid_seen")
    rollout = run_lockstep([bad_game, good], WalkthroughPolicy(), max_steps=30)
    trajs, stats = rollout.trajectories, rollout.stats
    assert trajs[0].stop_reason == "env_error" and str(broken) in trajs[0].error
    assert trajs[1].won
    assert stats.env_steps == len(good.walkthrough)


def test_max_steps_counts_invalid_actions(games):
    game = games["pick_two_obj_and_place"]

    class Babbler:
        def start(self, traj): ...
        def act(self, trajs): return ["Thought: hmm" for _ in trajs]
        def observe(self, traj, obs): ...

    rollout = run_lockstep([game], Babbler(), max_steps=4)
    (traj,) = rollout.trajectories
    assert traj.stop_reason == "max_steps" and len(traj.steps) == 4
    assert traj.invalid_actions == 4 and not traj.won
    assert all(s.observation == NOTHING_HAPPENS for s in traj.steps)
