"""agentrl on a Ray cluster (`--ray-address`), on this machine's local Ray: env workers as actors
behind the env pool's submit/collect/release, their failures, a two-node cluster simulated
here (`ray.cluster_utils.Cluster`), and bad addresses. Real games, the real tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional extra agentrl[ray] (the dev set-up installs it)")

from agentrl.rollout import ModelPolicy, WalkthroughPolicy, run_lockstep  # noqa: E402
from agentrl.weights import WeightsRef  # noqa: E402
from scripted import rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _ray_down_after_the_module():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray():
    """This machine's local Ray (started once; the two-node test shuts it down and starts its own)."""
    from agentrl import cluster

    cluster.connect("local", local_cpus=4)


def trace(rollout) -> list:
    """Everything a rollout produced, per trajectory: actions, commands, observations, rewards, tokens."""
    return [(t.game.game_id, t.index, t.stop_reason, t.reward, t.initial_observation, t.token_ids, t.action_mask,
             [(s.action, s.command, s.observation, s.won, s.done) for s in t.steps]) for t in rollout.trajectories]


def model_rollout(games, tiny_model, tokenizer, envs=None, on_step=None):
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.hf import HFSampler

    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 8), seed=11)
    return run_lockstep(games, policy, max_steps=3, fuzzy_threshold=0, group_size=2, envs=envs, on_step=on_step)


def test_a_rollout_through_ray_actors_equals_the_in_process_one(local_ray, games, tiny_model, tokenizer):
    from agentrl.env.ray_pool import RayEnvPool

    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"], games["pick_clean_then_place_in_recep"]]
    here = model_rollout(chosen, tiny_model, tokenizer)
    with RayEnvPool(2, "alfworld") as pool:
        there = model_rollout(chosen, tiny_model, tokenizer, envs=pool)
        assert pool.replaced == 0
    assert trace(there) == trace(here)
    assert all(len(t.steps) == 3 for t in there.trajectories)


def test_walkthroughs_through_ray_actors_win_every_game(local_ray, data_root):
    from agentrl.env import find_games
    from agentrl.env.ray_pool import RayEnvPool

    sample = find_games("alfworld", "valid_seen", data_root, limit=4)
    with RayEnvPool(2, "alfworld") as pool:
        pool.ready()
        rollout = run_lockstep(sample, WalkthroughPolicy(), max_steps=50, envs=pool)
        assert len({pid for _, pid in pool.placement()}) == 2  # two actors, two processes
    assert [t.won for t in rollout.trajectories] == [True] * len(sample)


def test_a_killed_env_actor_ends_only_its_trajectories_and_nothing_is_left_behind(local_ray, games, tiny_model, tokenizer):
    from agentrl.env.ray_pool import RayEnvPool

    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    pool = RayEnvPool(2, "alfworld")
    victim = pool.actors[0]
    pids = [pid for _, pid in pool.placement()]

    def kill_after_first_step(step, trajs):
        if step == 1 and pool.actors[0] is victim:
            ray.kill(victim, no_restart=True)

    rollout = model_rollout(chosen, tiny_model, tokenizer, envs=pool, on_step=kill_after_first_step)
    first, second = rollout.groups  # games go round-robin: the first game's envs were on actor 0
    assert [t.stop_reason for t in first.trajectories] == ["env_error"] * 2
    assert all("env actor died" in t.error for t in first.trajectories)
    assert [len(t.steps) for t in second.trajectories] == [3, 3] and pool.replaced == 1
    pids.append(pool.placement()[0][1])  # the replacement
    pool.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "an env actor's process outlived the pool"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_hung_env_actor_times_out_and_is_replaced(local_ray, games):
    from agentrl.env.ray_pool import RayEnvPool

    pool = RayEnvPool(1, "alfworld", timeout_s=120.0)
    try:
        game = games["pick_and_place_simple"]
        assert pool.collect(pool.submit("reset", [(0, game)]))[0].observation
        (fine,) = pool.collect(pool.submit("step", [(0, "look")]))
        assert fine.observation  # the actor answers ...
        pool.timeout_s = 2.0
        hang = pool.actors[0].__ray_call__.remote(lambda self: time.sleep(30))  # ... until it hangs
        (late,) = pool.collect(pool.submit("step", [(0, "look")]))
        assert "did not answer within 2s" in late.message and pool.replaced == 1
        pool.timeout_s = 120.0
        (fresh,) = pool.collect(pool.submit("reset", [(1, game)]))  # the replacement serves new envs
        assert fresh.observation
        del hang
    finally:
        pool.shutdown()


def agentrl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def test_eval_with_ray_address_local_wins_the_walkthroughs(tmp_path):
    proc = agentrl("eval", "--policy", "walkthrough", "--split", "valid_seen", "--limit", "3", "--ray-address", "local",
                   "--env-workers", "2", "--out", str(tmp_path / "ev"))
    assert proc.returncode == 0, proc.stderr
    overall = json.loads((tmp_path / "ev" / "summary.json").read_text())["overall"]
    assert overall["won"] == overall["episodes"] == 3


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "no Ray cluster at 127.0.0.1:1"),
    ("not an address", "ray_address must be local, auto or HOST:PORT"),
])
def test_a_bad_ray_address_is_one_line_and_exit_2_before_anything_is_written(tmp_path, address, message):
    out = tmp_path / "ev"
    proc = agentrl("eval", "--policy", "walkthrough", "--split", "valid_seen", "--limit", "1", "--ray-address", address,
                   "--out", str(out), timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_two_sampler_replicas_give_the_trajectories_one_sampler_gives(local_ray, tiny_actor_dir, tmp_path):
    """Each row carries its own seed, so splitting a step's batch over two replicas (a task stays on
    one) changes nothing: same tokens, same log-probs (to float precision), same actions. The
    reference runs with one torch thread, as each replica actor does (Ray gives it one CPU). Then
    a hot-swap reaches both replicas and both report (and serve) the new version; closing deletes
    each replica's copy of the adapter."""
    import torch
    from peft import LoraConfig, get_peft_model

    from agentrl.config import load_config
    from agentrl.env import find_games
    from agentrl.env.synthetic import synthetic_messages
    from agentrl.models import load_model
    from agentrl.sampling import make_sampler
    from agentrl.sampling.base import SamplingParams
    from agentrl.sampling.replicas import ReplicatedSampler

    base = {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "cluster.ray_address": "local"}
    games = find_games("synthetic", "train", limit=4)
    params = SamplingParams(1.0, 1.0, 12)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_lockstep(games, ModelPolicy(make_sampler(load_config(None, base)), params, seed=4, messages=synthetic_messages), max_steps=2,
                           fuzzy_threshold=0, group_size=3, make_env=_synthetic)
    finally:
        torch.set_num_threads(threads)
    import tempfile

    def copies() -> set:  # the local replicas' temp folder is this process's
        return set(Path(tempfile.gettempdir()).glob("agentrl-adapter-v3-*"))

    before = copies()
    replicated = ReplicatedSampler(load_config(None, base | {"sampling.replicas": 2}))
    try:
        assert len({pid for _, pid in replicated.placement}) == 2
        two = run_lockstep(games, ModelPolicy(replicated, params, seed=4, messages=synthetic_messages), max_steps=2, fuzzy_threshold=0, group_size=3,
                           make_env=_synthetic)
        assert set(replicated._replica_of.values()) == {0, 1}  # both replicas served tasks
        # a hot-swap reaches every replica, and each reports the version it now serves
        model = load_model(str(tiny_actor_dir), "float32", "cpu")[0]
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(tmp_path / "v3")
        replicated.load(WeightsRef(str(tmp_path / "v3"), 3))
        assert replicated.served_versions() == [3, 3] and replicated.adapter_version == 3
        again = rows([one.trajectories[0].token_ids[:20]] * 2, seeds=[1, 2], keys=[("a", 0), ("b", 0)])
        assert {c.adapter_version for c in replicated.generate(again, params)} == {3}
        assert len(copies() - before) == 2  # each replica serves its own copy
    finally:
        replicated.close()
    assert copies() - before == set()  # and deletes it when closed
    assert [(t.token_ids, t.stop_reason) for t in two.trajectories] == [(t.token_ids, t.stop_reason) for t in one.trajectories]
    for a, b in zip(two.trajectories, one.trajectories):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _synthetic(game):
    from agentrl.env.synthetic import SyntheticEnv

    return SyntheticEnv(game)


def test_train_over_ray_then_resume_equals_an_uninterrupted_run(local_ray, tmp_path, tiny_actor_dir, monkeypatch):
    """`agentrl train` over Ray: the learner is an actor (adapters and checkpoint states come back
    through the object store), the envs are actors; 2 iterations + resume to 3 equal 3 straight.
    The sampler in the driver is tests/scripted.py's (reward variance by construction)."""
    import agentrl.sampling as sampling
    from scripted import ScriptedSampler
    from test_train_loop import read_metrics, run_train, tiny_cfg

    from agentrl.train.ray_learner import RayLearner

    real = sampling.make_sampler
    monkeypatch.setattr(sampling, "make_sampler", lambda cfg, *a, **k: ScriptedSampler(real(cfg, *a, **k)))
    made = []
    monkeypatch.setattr(RayLearner, "__init__", _recording(RayLearner.__init__, made))
    ray_run = {"cluster.ray_address": "local", "env.workers": 2, "train.eval_tasks": 2}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, tiny_cfg(tiny_actor_dir, **ray_run))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **ray_run | {"train.iterations": 2}))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **ray_run), resume=True)
    assert len(made) == 3 and all(pid != os.getpid() for pid in made)  # the learner was an actor every time
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["adapter_version"] for r in a if r["kind"] == "iteration"] == [1, 2, 3]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]  # noqa: E731
    assert strip(b) == strip(a)
    assert sorted(p.name for p in (resumed / "adapters").glob("v*")) == ["v2", "v3"]


def _recording(init, made):
    def wrapped(self, cfg):
        init(self, cfg)
        made.append(self.pid)
    return wrapped


def test_replicas_above_the_clusters_gpus_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    proc = agentrl("train", "--config", "configs/synthetic.yaml", "--ray-address", "local", "--sampler-replicas", "2",
                   "--sampler-device", "cuda", "--out", str(out), timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sampling.replicas 2 needs 2 GPUs (one per replica); the cluster has 0" in proc.stderr
    assert not out.exists()


def test_env_actors_are_placed_on_both_nodes_of_a_two_node_cluster(data_root):
    """`ray.cluster_utils.Cluster` simulates two nodes on this machine: SPREAD places the env
    actors on both; the walkthroughs still win every game."""
    from ray.cluster_utils import Cluster

    from agentrl.env import find_games
    from agentrl.env.ray_pool import RayEnvPool

    if ray.is_initialized():
        ray.shutdown()
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    two.add_node(num_cpus=2)
    try:
        ray.init(address=two.address, log_to_driver=False)
        sample = find_games("alfworld", "valid_seen", data_root, limit=4)
        with RayEnvPool(2, "alfworld") as pool:
            nodes = {node for node, _ in pool.placement()}
            rollout = run_lockstep(sample, WalkthroughPolicy(), max_steps=50, envs=pool)
        assert len(nodes) == 2
        assert all(t.won for t in rollout.trajectories)
    finally:
        ray.shutdown()
        two.shutdown()


def test_the_ray_learner_keeps_the_learner_contract_with_the_in_process_numbers(local_ray, tmp_path, tiny_actor_dir):
    """The learner as a Ray actor keeps handoff.Learner's contract (weights and states through the
    object store) and trains to the numbers the in-process learner trains to."""
    from test_learner import learner_contract

    from agentrl.config import load_config
    from agentrl.train.ray_learner import RayLearner
    from agentrl.train.remote import make_learner

    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "learner.lora_r": 4, "learner.lora_alpha": 8,
                             "learner.target_modules": ["q_proj", "v_proj"], "learner.lr": 1e-2, "seed": 3})
    seen = learner_contract(RayLearner(cfg), tmp_path / "ray")
    assert seen == learner_contract(make_learner(cfg), tmp_path / "local")
