"""`agentrl train` end to end on a tiny model and the synthetic task: metrics, checkpoints,
exact resume, run-directory safety. Real components: the HF sampler with LoRA hot-swap, the
PEFT learner, the lockstep runner; the model is the tiny Llama of conftest.py taught the reply
format in the fixture (a random 2-layer model would never produce a valid action). The sampler
is wrapped in the ScriptedSampler of tests/scripted.py, which writes some trajectories' replies
(with the real model's log-probs) so that the events these tests check (reward variance, an
update, a gate cut, a prune) happen by construction on any CPU, not by sampled luck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from agentrl.config import load_config
from agentrl.errors import UserError
from agentrl.train.loop import train
from agentrl.train.prerun import prepare_run, start_run

ITERATION_FIELDS = {
    "iteration", "groups", "groups_cut", "zero_variance_groups", "zero_variance_all_fail", "zero_variance_all_success",
    "zero_adv_fraction", "grad_l2_norm", "loss", "loss_mean", "grad_l2_norm_mean", "grad_l2_norm_max", "train_reward", "train_success", "step_tokens_generated", "step_tokens_trained",
    "rollout_s", "train_s", "swap_s", "eval_s", "adapter_version", "logprob_gap",
}


@pytest.fixture(autouse=True)
def script(monkeypatch):
    """Every sampler `make_sampler` builds here is scripted; a test may change `script.modes`."""
    from types import SimpleNamespace

    import agentrl.sampling as sampling
    from scripted import ScriptedSampler

    real, state = sampling.make_sampler, SimpleNamespace(modes=("split",), samplers=[])

    def make(cfg, *args, **kwargs):
        state.samplers.append(ScriptedSampler(real(cfg, *args, **kwargs), state.modes))
        return state.samplers[-1]

    monkeypatch.setattr(sampling, "make_sampler", make)
    return state


def tiny_cfg(model_dir: Path, **overrides):
    base = {
        "model.name": str(model_dir), "env.kind": "synthetic", "env.max_steps": 2, "env.fuzzy_threshold": 0.0,
        "rollout.gate": "off",
        "rollout.tasks": 3, "rollout.group_size": 4, "sampling.temperature": 1.0, "sampling.max_new_tokens": 16,
        "learner.lora_r": 4, "learner.lora_alpha": 8, "learner.target_modules": ["q_proj", "v_proj"],
        "learner.lr": 1e-2, "train.iterations": 3, "train.eval_every": 2, "train.eval_tasks": 4, "seed": 3,
    }
    return load_config(None, base | overrides)


def run_train(run: Path, cfg, resume=False, hooks=None):
    if not resume:
        start_run(run, prepare_run(run, cfg, resume=False, force=False), force=False)
    else:
        cfg = prepare_run(run, None, resume=True, force=False, overrides={"train.iterations": cfg.train.iterations})
    return train(cfg, run, resume=resume, hooks=hooks)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_checkpoints_and_swaps_adapters(tmp_path, tiny_actor_dir):
    from agentrl.cli.display import metrics_line, phase_label
    from agentrl.train.loop import Hooks

    run, phases = tmp_path / "run", []
    hooks = Hooks(phase=lambda name, total=None, iteration=0: phases.append(phase_label(name, iteration, 3)))
    run_train(run, tiny_cfg(tiny_actor_dir, **{"env.workers": 2}), hooks=hooks)  # envs in a pool of worker processes
    # the progress bar names what runs and for which iteration, as the metrics lines do
    assert phases[:5] == ["eval it 0", "rollout it 1/3", "train it 1/3", "swap it 1/3", "rollout it 2/3"]
    assert phases[-2:] == ["swap it 3/3", "eval it 3"]
    rows = read_metrics(run)
    its = [r for r in rows if r["kind"] == "iteration"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["iteration"] for r in its] == [1, 2, 3]
    assert [r["iteration"] for r in evals] == [0, 2, 3]  # iteration 0, every E=2, and the last
    assert ITERATION_FIELDS <= set(its[0])
    assert all(r["groups"] == 3 and r["groups_cut"] == 0 for r in its)
    for r in its:  # every group has reward variance (scripted), so every iteration updates
        assert r["zero_variance_groups"] == 0 and r["step_tokens_trained"] > 0 and r["grad_l2_norm"] > 0
        assert r["logprob_gap"] < 1e-3  # the sampler used exactly the adapter the learner had: same log-probs
        # one optimizer step: its mean is itself, and the console line says nothing more
        assert r["loss_mean"] == r["loss"] and r["grad_l2_norm_mean"] == r["grad_l2_norm"] == r["grad_l2_norm_max"]
        assert "steps:" not in metrics_line(r, 3)
    assert its[-1]["adapter_version"] == 3
    for before, row in zip([0] + [r["adapter_version"] for r in its], its):  # each rollout used the latest version
        assert row["rollout_adapter_versions"] == [before]
    assert (run / "checkpoints" / "latest").read_text().strip() == "it00003"
    assert len(list((run / "adapters").glob("v*"))) <= 2  # older versions pruned
    assert evals[0]["adapter_version"] == 0 and set(evals[0]["by_task_type"]) == {"synthetic_choice"}


def test_resume_continues_exactly(tmp_path, tiny_actor_dir):
    """2 iterations, stop, resume to 4 == 4 iterations straight (tasks, samples, losses, weights),
    with the learner taking several clipped steps per iteration (2 epochs x 2 minibatches: the
    minibatch order and the optimizer's moments must resume too)."""
    from agentrl.cli.display import metrics_line

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo = {"learner.epochs": 2, "learner.minibatches": 2, "learner.lr": 5e-3}
    run_train(straight, tiny_cfg(tiny_actor_dir, **{"train.iterations": 4}, **ppo))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **{"train.iterations": 2}, **ppo))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **{"train.iterations": 4}, **ppo), resume=True)
    keys = ("loss", "grad_l2_norm", "loss_mean", "grad_l2_norm_mean", "grad_l2_norm_max", "train_reward",
            "step_tokens_generated", "step_tokens_trained", "adapter_version", "optimizer_steps", "clip_fraction")
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["adapter_version"] for r in a if r["kind"] == "iteration"] == [1, 2, 3, 4]  # four real updates
    assert [r["optimizer_steps"] for r in a if r["kind"] == "iteration"] == [4, 4, 4, 4]
    assert [r["kind"] for r in a if r["kind"] == "iteration"] == [r["kind"] for r in b if r["kind"] == "iteration"]
    for x, y in zip([r for r in a if r["kind"] == "iteration"], [r for r in b if r["kind"] == "iteration"]):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
        assert x["grad_l2_norm_max"] >= x["grad_l2_norm_mean"] > 0
        # the console line's loss and |g| are the first step's; beside them the 4 steps' own
        assert (f"4 steps: loss mean {x['loss_mean']:+.4f} |g| mean {x['grad_l2_norm_mean']:.3f} "
                f"max {x['grad_l2_norm_max']:.3f}") in metrics_line(x, 4)
    assert [r["success"] for r in a if r["kind"] == "eval"] == [r["success"] for r in b if r["kind"] == "eval"]
    wa = load_file(str(straight / "checkpoints" / "it00004" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "it00004" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_resume_drops_metrics_after_the_checkpoint(tmp_path, tiny_actor_dir):
    """A line written for an iteration whose checkpoint never landed (killed in between), and a
    torn last line, are gone after resume; no iteration appears twice."""
    run = tmp_path / "run"
    run_train(run, tiny_cfg(tiny_actor_dir, **{"train.iterations": 1, "train.eval_tasks": 0}))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "iteration", "iteration": 2, "loss": 9.0}) + "\n" + '{"kind": "itera')
    run_train(run, tiny_cfg(tiny_actor_dir, **{"train.iterations": 2, "train.eval_tasks": 0}), resume=True)
    its = [r["iteration"] for r in read_metrics(run)]
    assert its == [1, 2] and read_metrics(run)[1]["loss"] != 9.0 and read_metrics(run)[1]["adapter_version"] == 2


def test_resume_keeps_an_eval_on_record_for_the_same_weights_and_games(tmp_path, tiny_actor_dir, monkeypatch):
    """A run that fails in its first update has recorded iteration 0's eval and no checkpoint:
    --resume starts over from iteration 1 but does not run that eval again; a record of other
    weights or games (its eval_key differs) is run again."""
    import shutil

    import agentrl.train.loop as loop

    real, ran = loop.evaluate, []
    monkeypatch.setattr(loop, "evaluate", lambda cfg, gen, games, it, *a: ran.append(it) or real(cfg, gen, games, it, *a))
    run = tmp_path / "run"
    monkeypatch.setenv("AGENTRL_FAULT", "enospc:update@1")
    with pytest.raises(OSError):
        run_train(run, tiny_cfg(tiny_actor_dir, **{"train.iterations": 2}))
    monkeypatch.delenv("AGENTRL_FAULT")
    (recorded,) = read_metrics(run)
    assert (recorded["kind"], recorded["iteration"], ran) == ("eval", 0, [0]) and recorded["eval_key"]
    assert not (run / "checkpoints" / "latest").exists()

    other = tmp_path / "other"
    shutil.copytree(run, other)
    (other / "metrics.jsonl").write_text(json.dumps(recorded | {"eval_key": "v1-of-other-weights"}) + "\n")

    ran.clear()
    run_train(run, tiny_cfg(tiny_actor_dir, **{"train.iterations": 2}), resume=True)
    rows = read_metrics(run)
    assert ran == [2]  # only iteration 2's eval ran: iteration 0's was on record
    assert [(r["kind"], r["iteration"]) for r in rows] == [("eval", 0), ("iteration", 1), ("iteration", 2), ("eval", 2)]
    assert rows[0] == recorded

    ran.clear()
    run_train(other, tiny_cfg(tiny_actor_dir, **{"train.iterations": 2}), resume=True)
    assert ran == [0, 2] and read_metrics(other)[0]["eval_key"] == recorded["eval_key"]


def test_run_directory_is_never_overwritten_silently(tmp_path, tiny_actor_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already holds a run; continue it with --resume"):
        prepare_run(run, tiny_cfg(tiny_actor_dir), resume=False, force=False)
    with pytest.raises(UserError, match="no config.yaml"):
        prepare_run(tmp_path / "nothing", None, resume=True, force=False)
    assert (run / "notes.txt").read_text() == "mine"


def test_more_tasks_than_the_pool_is_a_clear_error(tmp_path, tiny_actor_dir):
    cfg = tiny_cfg(tiny_actor_dir, **{"env.kind": "alfworld", "rollout.split": "valid_seen", "rollout.tasks": 500})
    with pytest.raises(UserError, match="rollout.tasks=500 but split 'valid_seen' has only"):
        train(cfg, tmp_path / "run")


def test_tier2_offpolicy_ab_from_the_command_line(tmp_path, tiny_actor_dir):
    """`agentrl rollout --gate off` makes a frozen buffer; `agentrl train --off-policy ... --ab`
    replays it through both arms and writes the Table 4 analogue."""
    import subprocess
    import sys

    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"model: {{name: '{tiny_actor_dir}'}}\nenv: {{kind: synthetic, max_steps: 2, fuzzy_threshold: 0.0}}\n"
        "sampling: {temperature: 1.0, max_new_tokens: 16}\nrollout: {tasks: 6, group_size: 4, gate: 'off'}\n"
        "learner: {lora_r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}\n"
    )

    def agentrl(*args, entry=("-m", "agentrl.cli")):
        proc = subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    # the buffer's groups have reward variance by construction (the scripted CLI), so both arms train
    agentrl("rollout", "--config", str(config), "--out", str(tmp_path / "buffer"),
            entry=(str(Path(__file__).with_name("scripted_cli.py")),))
    out = agentrl("train", "--config", str(config), "--off-policy", str(tmp_path / "buffer" / "trajectories.jsonl"),
                  "--steps", "2", "--groups-per-step", "3", "--positions", "2", "--gate", "1,0.99", "--ab",
                  "--out", str(tmp_path / "ab"))
    report = json.loads((tmp_path / "ab" / "offpolicy.json").read_text())
    base, gated = report["arms"]["baseline"], report["arms"]["gated"]
    assert base["groups_cut"] == 0 and base["items"] > 0
    assert gated["groups_cut"] + gated["groups_used"] == base["groups_used"] == 6  # same planned groups
    assert gated["items"] <= base["items"]
    for row in ("total step wall-clock", "train items", "groups cut", "mean gradient L2 norm"):
        assert row in out and row in (tmp_path / "ab" / "offpolicy.md").read_text()


def test_two_process_layout_trains_and_the_sampler_uses_the_learners_adapter(tmp_path, tiny_actor_dir, tokenizer):
    """The learner in its own spawned process (train.layout split, both on CPU here): two
    iterations give the same losses as one process, and the sampler's logits are those of the
    adapter version the learner process wrote (loaded independently with PEFT)."""
    import copy

    import torch
    from peft import PeftModel

    from agentrl.models import load_model
    from agentrl.sampling import make_sampler

    def two_iterations(run, layout):
        cfg = tiny_cfg(tiny_actor_dir, **{"train.iterations": 2, "train.eval_tasks": 0, "train.layout": layout})
        start_run(run, cfg, force=False)
        sampler = make_sampler(cfg)
        train(cfg, run, sampler=sampler)
        return sampler, [r for r in read_metrics(run) if r["kind"] == "iteration"]

    sampler, split = two_iterations(tmp_path / "split", "split")
    _, colocated = two_iterations(tmp_path / "colocate", "colocate")
    keys = ("loss", "grad_l2_norm", "step_tokens_trained", "adapter_version")
    assert [{k: r[k] for k in keys} for r in split] == [{k: r[k] for k in keys} for r in colocated]
    version = split[-1]["adapter_version"]
    assert version == 2 and sampler.adapter_version == version  # both iterations updated (scripted variance)
    base = load_model(str(tiny_actor_dir), "float32", "cpu", False)[0]
    reference = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "split" / "adapters" / f"v{version}")).eval()
    ids = torch.tensor([tokenizer("Action: move mug 1 to fridge 1", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.allclose(sampler.model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)


def test_a_dead_learner_process_is_a_clear_error(tmp_path, tiny_actor_dir):
    import os
    import signal

    from agentrl.train.remote import LearnerDied, RemoteLearner, TrainItem

    learner = RemoteLearner(tiny_cfg(tiny_actor_dir))
    assert learner.pid != os.getpid() and learner.process.is_alive()
    os.kill(learner.pid, signal.SIGKILL)
    item = TrainItem([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -1.0])
    with pytest.raises(LearnerDied, match=r"the learner process \(pid \d+\) died during update \(exit code -9\)"):
        learner.update([(item, 1.0)])
    learner.close()
    assert not learner.process.is_alive()


def test_stale_adapters_and_logprob_gaps_are_warned_about():
    from types import SimpleNamespace

    from agentrl.train.learner import UpdateStats
    from agentrl.train.loop import check_served_version, check_update

    said = []
    check_update(5, UpdateStats(0.1, 1.0, 8, 100, logprob_gap=0.4), 0.1, said.append)
    check_update(6, UpdateStats(0.1, 1.0, 8, 100, logprob_gap=1e-6), 0.1, said.append)
    check_update(7, UpdateStats(float("nan"), float("nan"), 8, 100, None, skipped=True, stepped=False), 0.1, said.append)
    rollout = SimpleNamespace(trajectories=[SimpleNamespace(adapter_versions=[2, 2]), SimpleNamespace(adapter_versions=[3])])
    check_served_version(8, rollout, 3, said.append)
    check_served_version(9, SimpleNamespace(trajectories=[SimpleNamespace(adapter_versions=[None])]), 0, said.append)
    assert len(said) == 3
    assert said[0].startswith("iteration 5: sampler and learner disagree on action log-probs by 0.400")
    assert said[1].startswith("iteration 7: non-finite loss or gradient") and "update skipped" in said[1]
    assert said[2].startswith("iteration 8: rollouts used adapter version(s) [2, 3], the learner is at v3")


def test_non_finite_updates_are_skipped_then_the_run_stops_resumably(tmp_path, tiny_actor_dir):
    """A learner whose LoRA weights hold NaN produces a NaN loss: each update is skipped (no
    optimizer step, no new adapter, a warning), and after train.max_bad_updates in a row the run
    stops with one clear line; the checkpoints it wrote are complete."""
    import torch

    from agentrl.train import checkpoint
    from agentrl.train.remote import make_learner

    run = tmp_path / "run"
    cfg = tiny_cfg(tiny_actor_dir, **{"train.iterations": 5, "train.max_bad_updates": 2, "train.eval_tasks": 0})
    learner = make_learner(cfg)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.fill_(float("nan"))
    start_run(run, prepare_run(run, cfg, resume=False, force=False), force=False)
    warnings = []
    from agentrl.train.loop import Hooks

    with pytest.raises(UserError, match=r"2 non-finite updates in a row \(last at iteration 2\); stopping.*--resume"):
        train(cfg, run, learner=learner, hooks=Hooks(warn=warnings.append))
    rows = read_metrics(run)
    assert [(r["iteration"], r["skipped_update"], r["adapter_version"]) for r in rows] == [(1, True, 0), (2, True, 0)]
    assert sum("non-finite loss or gradient" in w for w in warnings) == 2
    assert checkpoint.latest(run).name == "it00002" and not (run / "adapters").exists()


SELECT_ALL = {"select.stages": "greso,pilot-commit,cut,arrol,dapo", "rollout.gate": "1,0.5", "select.gate_audit": 0.5,
              "select.dapo_refill": 1, "select.pilot_commit.n_pilot": 2, "select.arrol.K": 1, "select.arrol.cold_start": 1,
              "learner.lr": 2e-3, "train.eval_tasks": 0}


def test_selection_stages_compose_account_and_resume_exactly(tmp_path, tiny_actor_dir, script):
    """All five: GRESO, Pilot-Commit, the gate with its audit, ARRoL (pruning from iteration 2) and
    the DAPO filter with refill in one run:
    every iteration's step-tokens add up (generated = trained + kept out by stages + zero-advantage),
    each stage reports its decisions, and 2 iterations + resume equal 3 straight (stage state is
    in the checkpoint). The script gives the gate converged groups to cut (`stall`), ARRoL full
    groups still running at K=1 to prune (`wander`) and every other group reward variance."""
    script.modes = ("split", "stall", "wander")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, tiny_cfg(tiny_actor_dir, **SELECT_ALL))
    rows = [r for r in read_metrics(straight) if r["kind"] == "iteration"]
    assert len(rows) == 3
    for r in rows:
        assert set(r["stages"]) == {"greso", "pilot-commit", "cut", "arrol", "dapo"}
        # pilot tokens a commit carried from an earlier iteration were generated (and counted) then
        assert r["step_tokens_generated"] + r["step_tokens_carried"] == (
            r["step_tokens_trained"] + r["step_tokens_excluded_by_stages"] + r["step_tokens_zero_advantage"])
        pc = r["stages"]["pilot-commit"]["decisions"]
        assert pc["tasks_piloted"] == 9 * pc["rounds"]  # pilot_factor 3 x B 3 fresh tasks a round
        assert pc["tasks_committed"] >= 1
    assert sum(r["stages"]["cut"]["decisions"]["groups_cut"] + r["stages"]["cut"]["decisions"]["groups_audited"]
               for r in rows) > 0  # the gate acted on the stalled groups (K=1, d_L=0.5)
    assert rows[0]["stages"]["arrol"]["decisions"]["trajectories_pruned"] == 0  # cold start
    assert sum(r["stages"]["arrol"]["decisions"]["trajectories_pruned"] for r in rows) > 0
    run_train(resumed, tiny_cfg(tiny_actor_dir, **SELECT_ALL | {"train.iterations": 2}))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **SELECT_ALL), resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]  # noqa: E731
    assert strip(read_metrics(resumed)) == strip(read_metrics(straight))


def wandb_history(run: Path) -> dict[int, dict]:
    """step -> the logged keys and values, read from the offline run files (W&B's own protobuf
    records in its LevelDB-log format: 32 KiB blocks, 7-byte chunk headers, a 7-byte file header)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    def records(data: bytes):
        assert data[:4] == b":W&B"
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's trailer
                pos += 32768 - pos % 32768
                continue
            length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 1:
                yield chunk
            elif kind in (2, 3):
                pending = (pending if kind == 3 else b"") + chunk
            elif kind == 4:
                yield pending + chunk

    steps: dict[int, dict] = {}
    files = {p.resolve() for p in (run / "wandb").glob("*/run-*.wandb")}
    for f in sorted(files):
        for raw in records(f.read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                steps.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return steps


def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds_and_resume_appends(tmp_path, tiny_actor_dir, monkeypatch):
    """--log-to tensorboard,wandb: TensorBoard's own reader and W&B's offline run files hold, per
    iteration, the scalars of metrics.jsonl (nested fields by path, evals under eval/); a resumed
    run continues the same TensorBoard run and W&B run id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentrl.train.loggers import scalars

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "logged"
    cfg = tiny_cfg(tiny_actor_dir, **{"train.log_to": "tensorboard,wandb", "train.iterations": 2, "train.eval_every": 1,
                                      "train.eval_tasks": 2})
    run_train(run, cfg)
    run_id = (run / "wandb_run_id").read_text().strip()
    run_train(run, tiny_cfg(tiny_actor_dir, **{"train.iterations": 3}), resume=True)
    assert (run / "wandb_run_id").read_text().strip() == run_id

    rows = read_metrics(run)
    assert [r["iteration"] for r in rows if r["kind"] == "iteration"] == [1, 2, 3]
    want: dict[tuple[str, int], float] = {}
    for r in rows:
        for k, v in scalars(r).items():
            want[(k, r["iteration"])] = v
    assert ("eval/success", 0) in want and ("loss", 3) in want and ("eval/by_task_type/synthetic_choice/success", 2) in want

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert set(got) == set(want)
    assert all(got[k] == pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in want.items())  # float32 in the events

    history = wandb_history(run)
    assert sorted(history) == [0, 1, 2, 3]  # the resumed part appended to the same run
    for (k, step), v in want.items():
        assert history[step][k] == pytest.approx(v, rel=1e-9, abs=1e-12)
    assert {(k, s) for s, items in history.items() for k in items} == set(want)


def test_the_auto_gate_learns_its_threshold_in_a_run_and_resumes_exactly(tmp_path, tiny_actor_dir, script):
    """`--gate 1,auto` (a cut rests on >= 5 labels): the script makes two tasks in three stall (all
    trajectories the same invalid reply: d_1 = 0, all fail) and the others wander (trajectory 0
    wins at step 1, the rest stall: d_1 = 0.5 exactly, then reward variance). Nothing at K = 1
    depends on what the model samples. Iteration 1 has no labels and cuts nothing; from its labels
    the fit finds d_L = 0.25, which cuts (or audits) exactly the stalled groups of the next
    iterations. The labels are in the checkpoint: 2 + resume == 3 straight."""
    script.modes = ("wander", "stall", "stall")
    auto = {"rollout.gate": "1,auto", "select.gate_audit": 0.5, "gate.min_labels": 5, "rollout.tasks": 10,
            "train.eval_tasks": 0, "learner.lr": 2e-3}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, tiny_cfg(tiny_actor_dir, **auto))
    rows = [r for r in read_metrics(straight) if r["kind"] == "iteration"]
    cut = [r["stages"]["cut"] for r in rows]
    stalled = [r["groups_cut"] + r["zero_variance_groups"] for r in rows]  # wander groups always have variance
    assert cut[0]["decisions"] == {"groups_cut": 0, "groups_audited": 0}
    assert stalled[0] >= 5, "the run seed's tasks must give the fit 5 stalled groups in iteration 1"
    assert cut[0]["extra"]["auto"]["labelled"] == 10 and 0 < cut[0]["extra"]["auto"]["d_L"] < 0.5
    for r in rows:  # the cut groups (stalled: no win) are left out of the reward, and in the success as losses
        assert r["train_success"] * r["groups"] == pytest.approx(r["train_reward"] * (r["groups"] - r["groups_cut"]))
        assert 0 < r["train_success"] < r["train_reward"] or not r["groups_cut"]
    assert any(r["groups_cut"] for r in rows)
    for n, c in zip(stalled[1:], cut[1:]):  # every stalled group fires, and nothing else
        assert c["decisions"]["groups_cut"] + c["decisions"]["groups_audited"] == n
        assert c["precision"] == 1.0 if c["decisions"]["groups_audited"] else "precision" not in c
    run_train(resumed, tiny_cfg(tiny_actor_dir, **auto | {"train.iterations": 2}))
    run_train(resumed, tiny_cfg(tiny_actor_dir, **auto), resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]  # noqa: E731
    assert strip(read_metrics(resumed)) == strip(read_metrics(straight))
