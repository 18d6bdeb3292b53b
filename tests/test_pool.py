"""The env process pool on real games: same results as envs in this process, a killed worker
is replaced (its envs fail, the others go on), shutdown leaves no process behind."""

import os
import signal

import pytest

from agentrl.env.alfworld import AlfworldEnv
from agentrl.env.pool import EnvFailure, EnvPool


def test_pool_equals_in_process_envs_and_survives_a_killed_worker(games):
    a, b = games["pick_and_place_simple"], games["look_at_obj_in_light"]
    handles = [(0, a), (1, a), (2, b), (3, b)]
    local = {h: AlfworldEnv(g) for h, g in handles}
    want_first = [local[h].reset() for h, _ in handles]
    plan = [[(0, a.walkthrough[0]), (1, None), (2, b.walkthrough[0]), (3, "look")],
            [(0, a.walkthrough[1]), (1, "look"), (2, b.walkthrough[1]), (3, None)]]
    with EnvPool(workers=2) as pool:
        pids = pool.pids
        assert pool.reset_all(handles) == want_first
        for step in plan:
            assert pool.step_all(step) == [local[h].step(c) for h, c in step]
        victim = pool._owner[0]  # envs of one game share a worker
        assert pool._owner[1] == victim and pool._owner[2] != victim
        os.kill(pids[victim], signal.SIGKILL)
        after = pool.step_all([(h, "look") for h, _ in handles])
        lost = [h for h, _ in handles if pool._owner.get(h) is None]
        assert lost == [0, 1] and pool.replaced == 1
        assert all(isinstance(after[h], EnvFailure) and "died" in after[h].message for h in (0, 1))
        assert after[2] == local[2].step("look") and after[3] == local[3].step("look")
        assert pool.reset_all([(4, a)])[0] == want_first[0]  # the new worker serves new envs
        alive = pool.pids
    for pid in alive:
        assert not _alive(pid)
    for env in local.values():
        env.close()


def test_a_bad_game_fails_only_its_env(games, tmp_path):
    from dataclasses import replace

    broken = tmp_path / "game.tw-pddl"
    broken.write_text('{"pddl_domain": "(define", "pddl_problem": "", "grammar": "", "solvable": true}')
    good = games["pick_and_place_simple"]
    with EnvPool(workers=1) as pool:
        out = pool.reset_all([(0, replace(good, path=broken)), (1, good)])
        assert isinstance(out[0], EnvFailure) and "cannot load game" in out[0].message
        assert "Your task is to:" in out[1].observation and pool.replaced == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not a live process
        return f.read().split()[2] != "Z"


def test_lockstep_with_a_pool_equals_lockstep_in_process(games):
    from agentrl.rollout import WalkthroughPolicy, run_lockstep

    sample = [games[t] for t in ("pick_and_place_simple", "pick_cool_then_place_in_recep", "look_at_obj_in_light")]
    local = run_lockstep(sample, WalkthroughPolicy(), max_steps=30, group_size=2)
    with EnvPool(workers=2) as pool:
        pooled = run_lockstep(sample, WalkthroughPolicy(), max_steps=30, group_size=2, envs=pool)
        assert pool._owner == {}  # every env released at the end
    assert [t.steps for t in pooled.trajectories] == [t.steps for t in local.trajectories]
    assert [t.stop_reason for t in pooled.trajectories] == ["won"] * 6
    assert pooled.stats.env_steps == local.stats.env_steps


def test_a_worker_killed_mid_rollout_ends_only_its_trajectories(games):
    from agentrl.rollout import WalkthroughPolicy, run_lockstep

    sample = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    with EnvPool(workers=2) as pool:
        def kill_first_worker(step, trajs):
            if step == 1:
                os.kill(pool.pids[0], signal.SIGKILL)

        rollout = run_lockstep(sample, WalkthroughPolicy(), max_steps=30, group_size=2, envs=pool, on_step=kill_first_worker)
        assert pool.replaced == 1
    reasons = [t.stop_reason for t in rollout.trajectories]
    assert reasons == ["env_error", "env_error", "won", "won"]  # game 0's group lived on worker 0
    # killed once every wave had step 1; with overlap, game 0's step 2 was already sent and may have been answered
    assert "died" in rollout.trajectories[0].error and len(rollout.trajectories[0].steps) in (1, 2)


@pytest.mark.parametrize("static, action_space", [("off", "free"), ("on", "free"), ("off", "admissible")])
def test_overlap_generates_one_wave_while_the_workers_step_the_other(games, tiny_model, tokenizer, static, action_space):
    """With a pool, the sampler's generate calls for one wave happen while the other wave's step
    is still with the workers, and the trajectories (tokens, actions, observations) are the
    ones of an in-process rollout with the same seeds; also with the captured step's engine
    (static decode, prefill at bucketed shapes: CUDA's defaults, run eagerly here), whose two
    waves decode from two spans of the store that holds still. Admissible actions make every
    reply end with the end-of-turn token (a command's last), whatever the model samples: the
    other wave's step must not forget that, or the turn is closed twice (found 2026-12-06 by
    the first vLLM rollouts, where env.overlap is on by default)."""
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.hf import HFSampler

    sample = [games[t] for t in ("pick_and_place_simple", "look_at_obj_in_light", "pick_heat_then_place_in_recep")]
    params = SamplingParams(1.0, 1.0, 8 if action_space == "free" else 32)
    reply = "react" if action_space == "free" else "action"

    def rollout(envs=None, in_flight=None):
        policy = ModelPolicy(HFSampler(tiny_model, tokenizer, static_decode=static, prefill_buckets=static), params, seed=3,
                             reply=reply, action_space=action_space)
        if in_flight is not None:
            act = policy.act

            def watched(trajs):
                # resets and steps the workers have not answered yet (releases are not waited for)
                in_flight.append(sum(p.op != "release" for q in envs._queue for p in q))
                return act(trajs)

            policy.act = watched
        return run_lockstep(sample, policy, max_steps=3, fuzzy_threshold=0, group_size=2, envs=envs)

    local = rollout()
    in_flight: list[int] = []
    with EnvPool(workers=2) as pool:
        pooled = rollout(pool, in_flight)
    if action_space == "admissible":  # every reply stopped: none was cut and closed by the renderer
        assert all(not t.cut_steps and len(t.step_tokens) == 3 for t in local.trajectories)
    assert [t.token_ids for t in pooled.trajectories] == [t.token_ids for t in local.trajectories]
    assert [t.steps for t in pooled.trajectories] == [t.steps for t in local.trajectories]
    assert len(in_flight) == 6  # two waves x three steps
    assert all(n > 0 for n in in_flight)  # every generate had env work (resets or steps) in flight


def test_a_hung_worker_is_replaced_after_the_timeout(games):
    """SIGSTOP a worker: it does not answer within env.worker_timeout_s, so it is killed and
    replaced; its envs fail with a clear reason, the next reset works on the new worker."""
    a = games["pick_and_place_simple"]
    with EnvPool(workers=1, timeout_s=120.0) as pool:
        first = pool.reset_all([(0, a)])[0]  # a cold worker may take seconds on a loaded machine
        pool.timeout_s = 2.0
        hung = pool.pids[0]
        os.kill(hung, signal.SIGSTOP)
        out = pool.step_all([(0, "look")])[0]
        assert isinstance(out, EnvFailure) and "did not answer within 2s during step" in out.message
        assert pool.replaced == 1 and pool.pids[0] != hung and not _alive(hung)
        pool.timeout_s = 120.0  # the new worker starts cold too
        assert pool.reset_all([(1, a)])[0] == first


def test_a_worker_whose_parent_is_gone_exits_quietly(capfd):
    """A killed run (kill, Ctrl-C) closes the pipe: the worker ends with exit code 0 and prints no traceback."""
    import multiprocessing as mp

    from agentrl.env.pool import _worker

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, "synthetic"), daemon=True)
    proc.start()
    child.close()
    parent.send(("reset", []))  # one request answered, then the parent's end goes away
    assert parent.recv() == []
    parent.close()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_an_env_that_fails_is_closed_and_gives_its_library_copy_back(games):
    """A real game whose step raises (the raise is the test's: a real engine failure cannot be
    provoked on demand): the worker drops the env and closes it, so its copy of fast_downward's
    library goes back to the free list instead of staying mapped for the worker's life."""
    from agentrl.env import alfworld
    from agentrl.env.pool import apply_batch

    class Breaks(AlfworldEnv):
        def step(self, command):
            raise RuntimeError("the engine broke")

    game = games["pick_and_place_simple"]
    envs: dict = {}
    assert "Your task is to:" in apply_batch(envs, Breaks, "reset", [(0, game)])[0].observation
    free = len(alfworld._FREE_LIBS)
    [out] = apply_batch(envs, Breaks, "step", [(0, "look")])
    assert isinstance(out, EnvFailure) and "the engine broke" in out.message
    assert envs == {} and len(alfworld._FREE_LIBS) == free + 1
