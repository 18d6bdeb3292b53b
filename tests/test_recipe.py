"""The recipe where the field has it (issue 48, item 5): the KL coefficient in the field's unit
(per action token), the success replay's behaviour-cloning term and its buffer across resume.
Tiny random Llama (conftest.py), constructed trajectories, real PEFT."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agentrl.config import LearnerConfig
from agentrl.train.bc import masked_nll_sum
from agentrl.train.handoff import TrainItem
from agentrl.train.learner import LocalLearner
from agentrl.train.loss import field_kl_coef, grpo_loss, kl_penalty


def cfg(**kw):
    return LearnerConfig(lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], micro_batch=2, grad_clip=None, **kw)


def item(n_prompt: int, n_action: int, seed: int, won: bool = False) -> TrainItem:
    """A constructed trajectory: `n_prompt` prompt tokens, then `n_action` action tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 2000, (n_prompt + n_action,), generator=g).tolist()
    mask = [0] * n_prompt + [1] * n_action
    return TrainItem(ids, mask, [0.0] * len(ids), [n_action], [n_prompt], won=won)


def perturb_reference(learner: LocalLearner, scale: float = 0.05) -> None:
    """A reference that is not the policy (else the KL and its gradient are exactly 0)."""
    g = torch.Generator().manual_seed(7)
    learner.reference = [r + scale * torch.randn(r.shape, generator=g) for r in learner.reference]


def grads_at_step(learner: LocalLearner) -> list[list[torch.Tensor]]:
    """Record the gradients each optimizer step of `learner` moves on."""
    seen, real = [], learner.optimizer.step

    def step(*a, **k):
        seen.append([p.grad.detach().clone() for p in learner.params])
        return real(*a, **k)

    learner.optimizer.step = step
    return seen


# ---------------------------------------------------------------- the KL coefficient's unit
# The constructed batch: 4 trajectories, A = (1, -1, 0, 0), with 3, 5, 2 and 6 action tokens.
# A = 0 ones get no forward pass: the trained-mean KL divides by the trained tokens, 3 + 5 = 8,
# while the policy term divides by N = 4 (seq-sum), all 16 action tokens (token-mean), or
# N x T_i (seq-mean-token-mean). Per action token, beta 50 is therefore worth:
#   seq-sum              50 x 4 / 8                 = 25
#   token-mean           50 x 16 / 8                = 100
#   seq-mean-token-mean  50 x 4 x mean(3, 5) / 8    = 100   (75 and 125 per trajectory)
HAND = {"seq-sum": 25.0, "token-mean": 100.0, "seq-mean-token-mean": 100.0}
ADVANTAGES = (1.0, -1.0, 0.0, 0.0)


def constructed_batch():
    return [(item(4, n, seed), a) for seed, (n, a) in enumerate(zip((3, 5, 2, 6), ADVANTAGES))]


@pytest.mark.parametrize("agg", sorted(HAND))
def test_the_kl_coefficient_in_the_fields_unit_on_a_constructed_batch(agg):
    assert field_kl_coef(50.0, agg, n_total=4, tokens_total=16, kl_tokens=8, seq_tokens=[3, 5]) == pytest.approx(HAND[agg])


@pytest.mark.parametrize("agg", sorted(HAND))
def test_the_learner_reports_it_each_update(tiny_model, agg):
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3, kl_coef=50.0, loss_agg=agg))
    stats = learner.update(constructed_batch())
    assert stats.kl_coef_field == pytest.approx(HAND[agg])
    per_token = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-3, kl_coef=0.01, loss_agg=agg, kl_unit="per-token"))
    assert per_token.update(constructed_batch()).kl_coef_field == 0.01  # given in the field's unit: itself


def test_kl_penalty_weighs_each_token_as_the_policy_term_does():
    """Hand-worked k3 values: d = ref - logp = (ln 2, 0 | -ln 2) on the action tokens gives
    k3 = e^d - d - 1 = (1 - ln 2, 0 | 0.5 + ln 2 - 1)."""
    import math

    logp = torch.zeros((2, 3))
    ref = torch.tensor([[5.0, math.log(2), 0.0], [0.0, -math.log(2), 9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    k = [1 - math.log(2), 0.0, 0.5 + math.log(2) - 1]
    assert float(kl_penalty(logp, ref, mask, "seq-sum", n_total=4)) == pytest.approx(sum(k) / 4)
    assert float(kl_penalty(logp, ref, mask, "token-mean", tokens_total=10)) == pytest.approx(sum(k) / 10)
    assert float(kl_penalty(logp, ref, mask, "seq-mean-token-mean", n_total=2)) == pytest.approx(((k[0] + k[1]) / 2 + k[2]) / 2)
    # with A = 1 on every token, the policy term has the same weights: grpo_loss of logp = -kl_penalty's aggregation of 1s
    ones = torch.ones((2, 3))
    assert float(grpo_loss(ones, mask, torch.ones(2), "seq-mean-token-mean", n_total=2)) == pytest.approx(-1.0)


@pytest.mark.parametrize("agg", ["seq-sum", "token-mean"])
def test_todays_beta_equals_its_field_unit_value_given_per_token(tiny_model, agg):
    """learner.kl_coef beta (trained-mean) and kl_unit per-token with beta_field (the value the
    first reports) make the same update: same loss, same weights after it. Every trajectory
    trained (A != 0), so the token-mean's A = 0 caveat does not arise."""
    batch = [(item(4, n, seed), a) for seed, (n, a) in enumerate(zip((3, 5, 2, 6), (1.0, -1.0, 0.5, -0.5)))]
    runs = {}
    for unit, beta in (("trained-mean", 50.0), ("per-token", None)):
        beta = beta if beta is not None else runs["trained-mean"][0].kl_coef_field
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, kl_coef=beta, loss_agg=agg, kl_unit=unit))
        perturb_reference(learner)
        runs[unit] = (learner.update(batch), [p.detach().clone() for p in learner.params])
    (a, wa), (b, wb) = runs["trained-mean"], runs["per-token"]
    assert a.kl_coef_field == pytest.approx({"seq-sum": 50 * 4 / 16, "token-mean": 50.0}[agg])
    assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.grad_l2_norm == pytest.approx(a.grad_l2_norm, rel=1e-5)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(wa, wb))


def test_the_kl_unit_is_checked():
    from agentrl.config import load_config
    from agentrl.errors import UserError

    with pytest.raises(UserError, match="learner.kl_unit must be one of trained-mean, per-token"):
        load_config(None, {"learner.kl_unit": "nats"})
    with pytest.raises(UserError, match="learner.replay_coef must be >= 0"):
        load_config(None, {"learner.replay_coef": -1.0})


# ---------------------------------------------------------------- success replay
def test_success_replay_adds_only_the_earlier_wins_behaviour_cloning_gradient(tiny_model):
    """Two learners from the same weights, replay on (coef 0.5) and off. Update 1: the buffer is
    empty, so both step on the same gradient; the won trajectory (only it) joins the buffer.
    Update 2: the gradients differ by exactly coef x the gradient of the won trajectory's mean NLL
    over its action tokens, taken at the same weights."""
    won, lost = item(6, 4, 1, won=True), item(6, 5, 2)
    first = [(won, 1.0), (lost, -1.0)]
    second = [(item(5, 3, 3, won=False), 1.0), (item(5, 6, 4), -1.0)]  # no win: nothing new joins
    on = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, replay_coef=0.5, replay_buffer=8))
    off = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2))
    g_on, g_off = grads_at_step(on), grads_at_step(off)
    s_on, s_off = on.update(first), off.update(first)
    assert all(torch.equal(a, b) for a, b in zip(g_on[0], g_off[0]))
    assert s_on.replay_buffer == 1 and s_on.replay_nll is None and s_off.replay_buffer is None
    assert [(c.token_ids, c.action_mask) for c in on.replay.items] == [(won.token_ids, won.action_mask)]

    # the BC term's own gradient at the weights update 2 starts from
    on.model.train()
    on.optimizer.zero_grad(set_to_none=True)
    nll, n = masked_nll_sum(on.model, on.inputs([won.token_ids], [[0]]), [won.action_mask])
    (0.5 * nll / n).backward()
    g_bc = [p.grad.detach().clone() for p in on.params]
    on.optimizer.zero_grad(set_to_none=True)
    assert n == 4

    s_on, s_off = on.update(second), off.update(second)
    assert s_on.replay_nll == pytest.approx(float(nll.detach()) / n, rel=1e-5) and s_on.replay_buffer == 1
    for a, b, c in zip(g_on[1], g_off[1], g_bc):
        assert torch.allclose(a, b + c, atol=1e-6, rtol=1e-5)
    assert any(c.abs().max() > 1e-4 for c in g_bc)  # the term is not vacuous


def test_the_buffer_keeps_the_newest_wins_and_survives_the_learner_state(tiny_model, tmp_path):
    learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, replay_coef=1.0, replay_buffer=2))
    wins = [item(4, 3, s, won=True) for s in range(3)]
    learner.update([(wins[0], 1.0), (item(4, 3, 9), -1.0)])
    learner.update([(wins[1], 1.0), (wins[2], 1.0), (item(4, 3, 10), -1.0)])
    assert [c.token_ids for c in learner.replay.items] == [wins[1].token_ids, wins[2].token_ids]  # the oldest left
    state = tmp_path / "state"
    state.mkdir()
    learner.save_state(state)
    resumed = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, replay_coef=1.0, replay_buffer=2))
    resumed.load_state(state, learner.version)
    assert json.loads((state / "success_replay.json").read_text()) == [[w.token_ids, w.action_mask] for w in wins[1:]]
    batch = [(item(4, 5, 11), 1.0), (item(4, 2, 12), -1.0)]
    a, b = learner.update(batch), resumed.update(batch)
    assert (a.loss, a.grad_l2_norm, a.replay_nll) == (b.loss, b.grad_l2_norm, b.replay_nll)
    assert all(torch.equal(x, y) for x, y in zip(learner.params, resumed.params))


@pytest.fixture
def scripted(monkeypatch):
    """Every sampler the loop builds is tests/scripted.py's: each group has a scripted win and loss."""
    import agentrl.sampling as sampling
    from scripted import ScriptedSampler

    real = sampling.make_sampler
    monkeypatch.setattr(sampling, "make_sampler", lambda cfg, *a, **k: ScriptedSampler(real(cfg, *a, **k), ("split",)))


def test_a_resumed_run_replays_the_same_buffer_as_an_uninterrupted_one(tmp_path, tiny_actor_dir, scripted):
    """`agentrl train` with the success replay: 3 iterations straight == 2, stop, resume to 3
    (losses, replay NLL and buffer, weights): the buffer came back from the checkpoint."""
    from safetensors.torch import load_file

    from agentrl.config import load_config
    from agentrl.train.loop import train
    from agentrl.train.prerun import prepare_run, start_run

    def run_train(run, iterations, resume=False):
        cfg = load_config(None, {
            "model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2, "env.fuzzy_threshold": 0.0,
            "rollout.gate": "off", "rollout.tasks": 3, "rollout.group_size": 4, "sampling.temperature": 1.0,
            "sampling.max_new_tokens": 16, "learner.lora_r": 4, "learner.lora_alpha": 8,
            "learner.target_modules": ["q_proj", "v_proj"], "learner.lr": 1e-2, "learner.replay_coef": 0.5,
            "learner.replay_buffer": 4, "train.iterations": iterations, "train.eval_tasks": 0, "seed": 3})
        if resume:
            cfg = prepare_run(run, None, resume=True, force=False, overrides={"train.iterations": iterations})
        else:
            start_run(run, prepare_run(run, cfg, resume=False, force=False), force=False)
        train(cfg, run, resume=resume)
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    straight = run_train(tmp_path / "straight", 3)
    run_train(tmp_path / "resumed", 2)
    resumed = run_train(tmp_path / "resumed", 3, resume=True)
    keys = ("loss", "grad_l2_norm", "train_reward", "replay_nll", "replay_buffer")
    a = [{k: r[k] for k in keys} for r in straight if r["kind"] == "iteration"]
    assert a == [{k: r[k] for k in keys} for r in resumed if r["kind"] == "iteration"]
    # the wins of iteration 1 join the buffer after its update: one scripted win per group, and any
    # row the tiny model happens to win with (it depends on the CPU's thread count), up to 4 kept
    wins = round(a[0]["train_reward"] * 3 * 4)
    assert a[0]["replay_nll"] is None and wins >= 3 and a[0]["replay_buffer"] == min(4, wins)
    assert a[1]["replay_nll"] is not None and a[2]["replay_nll"] is not None and a[2]["replay_buffer"] == 4
    wa, wb = (load_file(str(tmp_path / r / "checkpoints" / "it00003" / "adapter" / "adapter_model.safetensors"))
              for r in ("straight", "resumed"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("name", ["gigpo.yaml", "gigpo-cpu.yaml"])
def test_the_shipped_gigpo_configs_hold_gigpos_recipe(name):
    """Step-level credit, a win : invalid-action ratio of 10 : -0.1, KL 0.01 per action token on a
    token-mean loss; the GPU one at GiGPO's 16 x 8 for 150 iterations. The warm start (the KL's
    reference) is asked for when a run starts, not by the file."""
    from pathlib import Path

    from agentrl.config import load_config
    from agentrl.errors import UserError
    from agentrl.train.prerun import check_kl_reference

    c = load_config(Path(__file__).resolve().parents[1] / "configs" / name)
    assert (c.train.advantage, c.advantage.gamma, c.advantage.omega, c.advantage.std_norm) == ("gigpo", 0.95, 1.0, True)
    assert c.reward.invalid_action / 1.0 == pytest.approx(-0.1 / 10) and c.reward.invalid_action_in == "return"
    assert (c.learner.loss_agg, c.learner.kl_coef, c.learner.kl_unit) == ("token-mean", 0.01, "per-token")
    assert c.rollout.gate == "off"
    if name == "gigpo.yaml":
        assert (c.rollout.tasks, c.rollout.group_size, c.train.iterations) == (16, 8, 150)
    with pytest.raises(UserError, match=r"needs a reference: the warm start \(--init-adapter DIR\)"):
        check_kl_reference(c)


def test_the_shipped_raft_config_is_the_measured_run_from_learnings_warm_start():
    """configs/raft.yaml: raft over 4 iterations of 8 x 8, admissible, no gate, no KL, 16 steps an
    iteration; its warm start is configs/learning.yaml's in bf16, the recipe the measurement used."""
    from pathlib import Path

    from agentrl.config import load_config
    from agentrl.train.sft_plan import recipe

    configs = Path(__file__).resolve().parents[1] / "configs"
    c = load_config(configs / "raft.yaml")
    assert (c.train.advantage, c.rollout.tasks, c.rollout.group_size, c.train.iterations) == ("raft", 8, 8, 4)
    assert (c.sampling.action_space, c.rollout.gate, c.learner.kl_coef, c.learner.minibatches) == ("admissible", "off", 0.0, 16)
    assert recipe(c) == recipe(load_config(configs / "learning.yaml", {"model.dtype": "bf16-if-native"}))


# ---------------------------------------------------------------- agentrl sft --from (rejection-sampling fine-tuning)
def rollout_record(tokenizer, task: str, index: int, replies: list[str], won: bool, response=None) -> dict:
    """A trajectories.jsonl record as `agentrl rollout` writes it: prompt, then per step a reply
    (its ids and recorded text) and an observation."""
    from agentrl.env.data import Game
    from agentrl.rollout.trajectory import Step, Trajectory

    t = Trajectory(game=Game(task, "train", "pick_and_place_simple", None), index=index)
    t.append(tokenizer(f"Your task is to: {task}.", add_special_tokens=False).input_ids, generated=False)
    for i, reply in enumerate(replies):
        ids = tokenizer(reply, add_special_tokens=False).input_ids
        t.append(ids, generated=True, logprobs=[-0.5] * len(ids))
        t.step_tokens.append(len(ids))
        t.steps.append(Step(response if response is not None else tokenizer.decode(ids), "x", "x", "ok", won, won))
        t.append(tokenizer("\nObservation: ok\n", add_special_tokens=False).input_ids, generated=False)
    t.stop_reason = "won" if won else "lost"
    return t.record()


def write_rollout(path, records) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_sft_from_trains_on_exactly_the_won_trajectories_action_tokens(tmp_path, tiny_actor_dir, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    from agentrl.config import load_config
    from agentrl.train import sft

    records = [rollout_record(tokenizer, "put a mug", 0, ["Action: go to desk 1", "Action: take mug 1"], True),
               rollout_record(tokenizer, "put a mug", 1, ["Action: look", "Action: inventory"], False),
               rollout_record(tokenizer, "heat an egg", 0, ["Action: open fridge 1"], True)]
    write_rollout(tmp_path / "r1", records[:2])
    write_rollout(tmp_path / "r2", records[2:])
    trained, real = [], sft.masked_nll_sum

    def spy(model, batch, masks):  # what each micro-batch teaches: its sequences' ids and masks
        for (r, s, n), m in zip(batch.spans, masks):
            trained.append((batch.input_ids[r, s : s + n].tolist(), list(m)))
        return real(model, batch, masks)

    monkeypatch.setattr(sft, "masked_nll_sum", spy)
    cfg = sft.sft_prompt(load_config(None, {
        "model.name": str(tiny_actor_dir), "learner.lora_r": 4, "learner.lora_alpha": 8,
        "learner.target_modules": ["q_proj", "v_proj"], "sft.heldout_games": 0, "sft.epochs": 2, "sft.lr": 1e-2}))
    out = tmp_path / "rft"
    summary = sft.run_sft(cfg, out, model=AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer=tokenizer,
                          sources=[tmp_path / "r1", tmp_path / "r2" / "trajectories.jsonl"])
    won = sorted((r["token_ids"], r["action_mask"]) for r in records if r["won"])
    assert sorted(trained) == sorted(won * 2)  # two epochs over the two wins, and nothing else
    assert summary["sft"]["won"] == 2 and summary["sft"]["trajectories"] == 3 and summary["sft"]["examples"] == 2
    assert summary["sft"]["reply_tokens"] == sum(sum(m) for _, m in won)
    assert [d["path"] for d in summary["sft"]["from"]] == [str(tmp_path / "r1" / "trajectories.jsonl"),
                                                          str(tmp_path / "r2" / "trajectories.jsonl")]
    assert (out / "adapter_model.safetensors").is_file()
    assert sft.reusable(cfg, out, [tmp_path / "r1", tmp_path / "r2"]) is not None  # the same files: reusable
    write_rollout(tmp_path / "r2", records[2:] + records[:1])
    assert sft.reusable(cfg, out, [tmp_path / "r1", tmp_path / "r2"]) is None  # other contents: built again


def test_sft_from_walkthroughs_trains_the_wins_beside_the_first_walkthroughs(tmp_path, tiny_actor_dir, tokenizer,
                                                                          data_root, monkeypatch):
    """RFT's usual data set (the demonstrations and the wins): sft.from_walkthroughs N adds the
    round robin's first N walkthroughs, each once an epoch, and is part of the recipe."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from agentrl.config import load_config
    from agentrl.train import sft

    records = [rollout_record(tokenizer, "put a mug", 0, ["Action: go to desk 1", "Action: take mug 1"], True),
               rollout_record(tokenizer, "put a mug", 1, ["Action: look"], False)]
    write_rollout(tmp_path / "r1", records)
    trained, real = [], sft.masked_nll_sum

    def spy(model, batch, masks):
        for (r, s, n), m in zip(batch.spans, masks):
            trained.append((batch.input_ids[r, s : s + n].tolist(), list(m)))
        return real(model, batch, masks)

    monkeypatch.setattr(sft, "masked_nll_sum", spy)
    cfg = sft.sft_prompt(load_config(None, {
        "model.name": str(tiny_actor_dir), "data.root": str(data_root), "learner.lora_r": 4, "learner.lora_alpha": 8,
        "learner.target_modules": ["q_proj", "v_proj"], "sft.heldout_games": 0, "sft.epochs": 1, "sft.lr": 1e-2,
        "sft.games": 5, "sft.from_walkthroughs": 2}))
    out = tmp_path / "rft"
    summary = sft.run_sft(cfg, out, model=AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer=tokenizer,
                          cache_dir=tmp_path / "sft-data", sources=[tmp_path / "r1"])
    walkthroughs = sft.replay(cfg, sft.select_games(cfg, "train", 2), [], tokenizer, tmp_path / "sft-data", sft.SftHooks())[0]
    expected = [(records[0]["token_ids"], records[0]["action_mask"])]
    expected += [(e.token_ids, list(e.action_mask)) for e in walkthroughs.examples]
    assert len(walkthroughs.examples) == 2  # (sft.games is not what --from reads)
    assert sorted(trained) == sorted(expected)
    assert summary["sft"]["won"] == 1 and summary["sft"]["walkthroughs"] == 2 and summary["sft"]["examples"] == 3
    assert summary["recipe"]["from_walkthroughs"] == 2
    assert sft.reusable(cfg, out, [tmp_path / "r1"]) is not None
    alone = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, from_walkthroughs=0))
    assert "from_walkthroughs" not in sft.recipe(alone, [{"sha256": "x"}])  # wins alone: the recipe as before the option
    assert sft.reusable(alone, out, [tmp_path / "r1"]) is None  # another data set: built again


def test_sft_from_refuses_no_wins_and_another_tokenizer_in_one_line(tmp_path, tokenizer):
    from agentrl.errors import UserError
    from agentrl.train.rft import won_rollouts

    write_rollout(tmp_path / "lost", [rollout_record(tokenizer, "t", i, ["Action: look"], False) for i in range(2)])
    with pytest.raises(UserError, match=r"no won trajectory in .*lost/trajectories.jsonl \(2 trajectories\): nothing to clone"):
        won_rollouts([tmp_path / "lost"], tokenizer)
    with pytest.raises(UserError, match=r"--from .*nowhere: no such file \(expected trajectories.jsonl"):
        won_rollouts([tmp_path / "nowhere"], tokenizer)
    big = rollout_record(tokenizer, "t", 0, ["Action: look"], True)
    big["token_ids"][-1] = len(tokenizer) + 5
    write_rollout(tmp_path / "big", [big])
    with pytest.raises(UserError, match=r"big/trajectories.jsonl:1: token id \d+ is outside this model's tokenizer"):
        won_rollouts([tmp_path / "big"], tokenizer)
    other = rollout_record(tokenizer, "t", 0, ["Action: look"], True, response="Action: go to sofa 1")
    write_rollout(tmp_path / "other", [other])
    with pytest.raises(UserError, match=r"decode to 'Action: look', not its recorded 'Action: go to sofa 1'"):
        won_rollouts([tmp_path / "other"], tokenizer)
    (tmp_path / "junk.jsonl").write_text('{"task_id": "t"}\n')
    with pytest.raises(UserError, match=r"junk.jsonl:1: not a trajectory record"):
        won_rollouts([tmp_path / "junk.jsonl"], tokenizer)


def test_sft_from_a_missing_file_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "agentrl.cli", "sft", "--out", str(out), "--from", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "no such file" in p.stderr, p.stderr
    assert not out.exists()


def test_sft_from_with_games_is_refused_in_one_line(tmp_path, tokenizer):
    """--games picks walkthroughs, which --from replaces: silently ignored, it would mislead."""
    import subprocess
    import sys

    write_rollout(tmp_path / "r1", [rollout_record(tokenizer, "put a mug", 0, ["Action: look"], True)])
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "agentrl.cli", "sft", "--out", str(out), "--from", str(tmp_path / "r1"),
                        "--games", "5"], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--from-walkthroughs" in p.stderr, p.stderr
    assert not out.exists()


def test_gigpos_recipe_in_the_learner_per_step_advantages_per_token_kl_and_replay(tiny_model):
    """configs/gigpo.yaml's learner: per-reply advantages (GiGPO), token-mean, KL 0.01 per action
    token, with the success replay on: the update steps, reports beta as given, and the KL term
    is exactly kl_penalty's token-mean (the loss moves by 0.01 x the KL per token when it is on)."""
    batch = [(item(4, 3, 1, won=True), [1.0]), (item(4, 5, 2), [-1.0])]
    losses = {}
    for beta in (0.0, 0.01):
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg(lr=1e-2, loss_agg="token-mean", kl_coef=beta, kl_unit="per-token",
                                                              replay_coef=0.1))
        if beta:
            perturb_reference(learner)
        stats = learner.update(batch)
        assert stats.stepped and learner.replay.items and stats.replay_buffer == 1
        losses[beta] = stats
    on = losses[0.01]
    assert on.kl_coef_field == 0.01 and on.kl > 0
    assert on.loss == pytest.approx(losses[0.0].loss + 0.01 * on.kl, rel=1e-5)  # token-mean over all 8 action tokens
