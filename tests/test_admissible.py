"""The admissible action space (issue 48): constrained decoding over the step's admissible commands.

On the tiny random Llama (fp32, CPU): a constrained row produces exactly one of its commands
whatever the model prefers (commands that share prefixes, one that is a prefix of another), its
log-probs are the policy's renormalised over the allowed tokens and equal the learner's teacher-
forced ones (1e-5), forced tokens have log-prob 0, the static step equals the eager loop, and what
the trajectory stores survives its record and a Tier-3 resume. No test relies on which command a
model samples: each asserts a property that holds for every sample."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.prompt import ChatRenderer, reply_text
from agentrl.sampling.base import GenRequest, SamplingParams
from agentrl.sampling.constraint import CommandSet, advance, batch_tables, column_at, constrain
from agentrl.sampling.hf import HFSampler

COMMANDS = ["go to shelf 1", "go to shelf 10", "go to sidetable 1", "take apple 1 from shelf 1", "look", "inventory",
            "examine shelf 1", "put apple 1 in/on countertop 1"]


def command_set(tokenizer, commands=COMMANDS) -> CommandSet:
    r = ChatRenderer(tokenizer)
    return CommandSet.of({c: r.encode(reply_text(c, "action")) + r.end_of_turn_ids for c in commands})


def prompts(tokenizer, n=3):
    r = ChatRenderer(tokenizer)
    return [r.initial([{"role": "user", "content": f"You are in room {i}. Your task is to put an apple on a shelf."}])
            for i in range(n)]


# ---------------------------------------------------------------- the device rule, by hand
def test_the_allowed_tokens_are_the_alive_commands_next_tokens():
    """Commands [5 6 9], [5 7 9], [5 6 8 9] (two share a prefix; [5 6] begins two): the rule allows
    exactly the alive commands' t-th tokens, and a row with no alive command is left free."""
    cs = [CommandSet(((5, 6, 9), (5, 7, 9), (5, 6, 8, 9))), None]
    table, alive = batch_tables(cs, 6, "cpu")
    logits = torch.zeros((2, 12))
    allowed = lambda out: [torch.isfinite(row).nonzero().flatten().tolist() for row in out]  # noqa: E731
    assert allowed(constrain(logits, column_at(table, 0), alive)) == [[5], list(range(12))]
    alive = advance(alive, column_at(table, 0), torch.tensor([5, 3]))
    assert allowed(constrain(logits, column_at(table, 1), alive)) == [[6, 7], list(range(12))]
    alive = advance(alive, column_at(table, 1), torch.tensor([6, 3]))
    assert allowed(constrain(logits, column_at(table, 2), alive))[0] == [8, 9]
    alive = advance(alive, column_at(table, torch.tensor([2])), torch.tensor([9, 3]))  # a device-scalar t
    assert alive[0].tolist() == [True, False, False]
    assert allowed(constrain(logits, column_at(table, 3), alive))[0] == list(range(12))  # past its end: free


def test_allowed_along_and_match():
    cs = CommandSet.of({"a": (5, 6, 9), "b": (5, 7, 9), "c": (5, 6, 8, 9), "a again": (5, 6, 9)})
    assert cs.commands == ((5, 6, 9), (5, 7, 9), (5, 6, 8, 9))  # one reply, one entry
    assert cs.allowed_along([5, 6, 8, 9]) == [[5], [6, 7], [8, 9], [9]]
    assert cs.match([5, 6, 8, 9]) == "c" and cs.match([5, 6]) is None
    with pytest.raises(ValueError):
        CommandSet(())
    with pytest.raises(ValueError):
        cs.check_stops({8})  # 9 does not stop; 8 would stop inside "c"


# ---------------------------------------------------------------- the sampler
@pytest.mark.parametrize("static", ["off", "on"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_reply_is_one_of_its_commands(tiny_model, tokenizer, static, temperature):
    """A random model never writes `Action: ...` on its own; constrained, every row's reply is
    exactly one of its commands (each row its own set), ended by the end-of-turn token."""
    sampler = HFSampler(tiny_model, tokenizer, static_decode=static)
    sets = [command_set(tokenizer), command_set(tokenizer, COMMANDS[:3]), command_set(tokenizer, ["look"])]
    reqs = [GenRequest(p, seed=10 + i, constraint=c) for i, (p, c) in enumerate(zip(prompts(tokenizer), sets))]
    for c, cs in zip(sampler.generate(reqs, SamplingParams(temperature, 1.0, 24)), sets):
        assert tuple(c.token_ids) in cs.commands and c.finish_reason == "stop"
        assert cs.match(c.token_ids) in COMMANDS
    only = sampler.generate(reqs[2:], SamplingParams(temperature, 1.0, 24))[0]
    assert only.logprobs == [0.0] * len(only.token_ids)  # one command: every token forced, log-prob exactly 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_constrained_logprobs_are_the_renormalised_policy(tiny_model, tokenizer, temperature):
    """Each log-prob = log_softmax of the raw logits restricted to the allowed ids (temperature 1),
    computed here by an independent teacher-forced forward."""
    sampler = HFSampler(tiny_model, tokenizer)
    cs = command_set(tokenizer)
    prompt = prompts(tokenizer, 1)[0]
    c = sampler.generate([GenRequest(prompt, seed=3, constraint=cs)], SamplingParams(temperature, 1.0, 24))[0]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    for t, (token, allowed) in enumerate(zip(c.token_ids, cs.allowed_along(c.token_ids))):
        expected = float(logits[t, token] - torch.logsumexp(logits[t, allowed], dim=0))
        assert c.logprobs[t] == pytest.approx(expected, abs=1e-5)
        if len(allowed) == 1:
            assert c.logprobs[t] == 0.0


def test_static_step_equals_eager_under_constraints(tiny_model, tokenizer):
    sets = [command_set(tokenizer), command_set(tokenizer, COMMANDS[2:6]), None]
    reqs = [GenRequest(p, seed=7 + i, constraint=c) for i, (p, c) in enumerate(zip(prompts(tokenizer), sets))]
    for temperature in (0.0, 0.9):
        params = SamplingParams(temperature, 1.0, 16)
        eager = HFSampler(tiny_model, tokenizer, static_decode="off").generate(reqs, params)
        static = HFSampler(tiny_model, tokenizer, static_decode="on").generate(reqs, params)
        for a, b in zip(eager, static):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_row_tokens_depend_only_on_its_seed(tiny_model, tokenizer):
    """Alone or beside other (constrained or free) rows, a constrained row samples the same reply."""
    sampler = HFSampler(tiny_model, tokenizer)
    cs = command_set(tokenizer)
    p = prompts(tokenizer, 3)
    params = SamplingParams(1.0, 1.0, 24)
    alone = sampler.generate([GenRequest(p[0], seed=99, constraint=cs)], params)[0]
    mixed = sampler.generate([GenRequest(p[1], seed=5), GenRequest(p[2], seed=6, constraint=command_set(tokenizer, ["look"])),
                              GenRequest(p[0], seed=99, constraint=cs)], params)[2]
    assert alone.token_ids == mixed.token_ids


def test_bad_constraints_are_refused(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="CommandSet"):
        sampler.generate([GenRequest(prompts(tokenizer, 1)[0], constraint=["look"])], SamplingParams())
    r = ChatRenderer(tokenizer)
    no_stop = CommandSet.of({"look": r.encode("Action: look")})
    with pytest.raises(ValueError, match="stop token"):
        sampler.generate([GenRequest(prompts(tokenizer, 1)[0], constraint=no_stop)], SamplingParams())
    from agentrl.config import load_config
    from agentrl.errors import UserError

    load_config(None, {"sampling.action_space": "admissible", "sampling.backend": "vllm", "prompt.reply": "action"})  # vllm_admissible.py
    with pytest.raises(UserError, match="prompt.reply action"):
        load_config(None, {"sampling.action_space": "admissible", "prompt.reply": "react"})
    with pytest.raises(UserError, match="free or admissible"):
        load_config(None, {"sampling.action_space": "commands"})
    from agentrl.rollout.lockstep import ModelPolicy

    with pytest.raises(UserError, match=r"replies are 'react' .*set prompt.reply: action"):  # a model without a warm start
        ModelPolicy(sampler, SamplingParams(), reply="react", action_space="admissible")


# ---------------------------------------------------------------- sampler = learner
@pytest.mark.parametrize("history", [0, 1])
def test_sampler_logprobs_equal_the_learners(tiny_model, tokenizer, games, history):
    """A real constrained rollout on real games: the learner's teacher-forced log-probs (its own
    path: packing, the allowed ids per action token) equal the sampler's to 1e-5 (fp32), on the
    whole episode, or per reply under prompt.history 1; every action is valid."""
    import copy
    import dataclasses

    from agentrl.config import LearnerConfig
    from agentrl.rollout.lockstep import ModelPolicy, run_lockstep
    from agentrl.train.learner import LocalLearner, per_step_items

    sampler = HFSampler(tiny_model, tokenizer)
    game = games["pick_and_place_simple"]
    policy = ModelPolicy(sampler, SamplingParams(1.0, 1.0, 24), seed=2, reply="action", action_space="admissible",
                         history=history)
    rollout = run_lockstep([game], policy, max_steps=3, group_size=2)
    trajs = rollout.trajectories
    assert all(s.valid and s.match_score == 100.0 for t in trajs for s in t.steps)
    for t in trajs:
        assert len(t.allowed) == sum(t.action_mask)
        assert any(len(a) > 1 for a in t.allowed) and any(len(a) == 1 for a in t.allowed)  # chosen and forced tokens
    learner = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4))  # fresh LoRA: B = 0, the same policy
    items = per_step_items([(t, 1.0) for t in trajs], history) if history else [(t, 1.0) for t in trajs]
    for (t, _), logp in zip(items, learner._logprobs(items)):
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        assert torch.allclose(logp[mask], torch.tensor(t.logprobs)[mask], atol=1e-5)
    free = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4))._logprobs([(dataclasses.replace(trajs[0], allowed=[]), 1.0)])[0]
    mask = torch.tensor(trajs[0].action_mask, dtype=torch.bool)
    assert not torch.allclose(free[mask], torch.tensor(trajs[0].logprobs)[mask], atol=1e-3)  # the mask matters


def test_what_the_learner_needs_survives_the_record(tiny_model, tokenizer, games):
    from agentrl.rollout.lockstep import ModelPolicy, run_lockstep
    from agentrl.rollout.trajectory import Trajectory
    from agentrl.train.handoff import from_train_items, train_items

    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 24), seed=4, reply="action",
                         action_space="admissible")
    t = run_lockstep([games["look_at_obj_in_light"]], policy, max_steps=2).trajectories[0]
    again = Trajectory.from_json(t.to_json())
    assert again.allowed == t.allowed and t.record()["allowed"] == t.allowed
    (item, adv), = from_train_items(train_items([(t, 0.5)]))
    assert item.allowed == t.allowed and adv == 0.5


def test_forced_tokens_carry_no_gradient(tiny_model, tokenizer):
    """A forced token's log-prob is 0 whatever the weights: the loss's gradient through it is 0."""
    from agentrl.train.packing import pack, sequence_logprobs

    r = ChatRenderer(tokenizer)
    reply = r.encode("Action: look") + r.end_of_turn_ids
    ids = prompts(tokenizer, 1)[0] + reply
    mask = [0] * (len(ids) - len(reply)) + [1] * len(reply)
    batch = pack([ids], [[0]], "cpu", constraints=[(mask, [[t] for t in reply])])
    logp = sequence_logprobs(tiny_model, batch)
    assert logp[0, -len(reply):].abs().max().item() == 0.0
    assert not math.isnan(float(logp.detach().sum()))


def test_tier2_views_keep_the_sampled_spans_allowed_ids():
    """Tier 2 trains prefixes with some action spans masked in: each view carries exactly those
    spans' allowed ids, in order (the learner pairs them with the view's action tokens)."""
    from agentrl.train.offpolicy import BufferTrajectory, make_view

    mask = [0, 0, 1, 1, 0, 1, 1, 1, 0, 1]  # spans (2, 4), (5, 8), (9, 10)
    allowed = [[1], [2, 3], [4], [5, 6], [7], [8, 9]]
    traj = BufferTrajectory("t", 0, 1.0, list(range(10)), mask, [0.0] * 10, allowed=allowed)
    view = make_view(traj, [0, 2])
    assert view.allowed == [[1], [2, 3], [8, 9]] and sum(view.action_mask) == 3
    assert make_view(traj, [1]).allowed == [[4], [5, 6], [7]]
    assert make_view(BufferTrajectory("t", 0, 1.0, list(range(10)), mask, [0.0] * 10), [1]).allowed == []


def test_a_constrained_run_resumes_exactly(tmp_path, tiny_actor_dir):
    """`agentrl train --action-space admissible` on the synthetic task: 1 iteration, stop, resume to
    2 == 2 straight (losses, samples, weights); the learner renormalises over the stored allowed ids."""
    import json

    from safetensors.torch import load_file

    from agentrl.config import load_config
    from agentrl.train.loop import train
    from agentrl.train.prerun import prepare_run, start_run

    def cfg(iterations):
        return load_config(None, {
            "model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2, "rollout.gate": "off",
            "rollout.tasks": 2, "rollout.group_size": 4, "sampling.temperature": 1.0, "sampling.max_new_tokens": 16,
            "sampling.action_space": "admissible", "prompt.reply": "action", "learner.lora_r": 4, "learner.lora_alpha": 8,
            "learner.target_modules": ["q_proj", "v_proj"], "learner.lr": 1e-2, "learner.minibatches": 2,
            "train.iterations": iterations, "train.eval_every": 0, "train.eval_tasks": 0, "seed": 5})

    def run(path, iterations, resume=False):
        c = cfg(iterations)
        if resume:
            c = prepare_run(path, None, resume=True, force=False, overrides={"train.iterations": iterations})
        else:
            start_run(path, prepare_run(path, c, resume=False, force=False), force=False)
        train(c, path, resume=resume)
        return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if '"iteration"' in line]

    straight = run(tmp_path / "straight", 2)
    run(tmp_path / "resumed", 1)
    resumed = run(tmp_path / "resumed", 2, resume=True)
    keys = ("loss", "grad_l2_norm", "train_reward", "step_tokens_generated", "step_tokens_trained", "adapter_version")
    its = lambda rows: [{k: r.get(k) for k in keys} for r in rows if r.get("kind") == "iteration"]  # noqa: E731
    assert its(straight) == its(resumed) and len(its(straight)) == 2
    assert all(r["valid_action_rate"] == 1.0 for r in straight if r.get("kind") == "iteration")
    for name in ("straight", "resumed"):
        assert (tmp_path / name / "checkpoints" / "it00002").is_dir()
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "it00002" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "it00002" / "adapter" / "adapter_model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


# ---------------------------------------------------------------- the loop guard (sampling.loop_guard)
def test_the_loop_guard_takes_out_what_would_go_round_a_cycle_again(tiny_model, tokenizer, games):
    """Constructed histories: a command that would make the last p commands equal the p before them
    (p <= the guard) leaves the step's choice; where every command would, the choice is left whole;
    the guard needs the admissible action space."""
    from agentrl.errors import UserError
    from agentrl.rollout.lockstep import ModelPolicy
    from agentrl.rollout.trajectory import Step, Trajectory, repeats_a_cycle

    assert repeats_a_cycle(["a"], "a", 1) and not repeats_a_cycle(["a"], "b", 1)
    assert repeats_a_cycle(["a", "b", "a"], "b", 2) and not repeats_a_cycle(["a", "b", "a"], "b", 1)
    assert repeats_a_cycle(["a", "b", "c", "a", "b"], "c", 3) and not repeats_a_cycle(["a", "b", "c", "a", "b"], "c", 2)
    assert not repeats_a_cycle([], "a", 6)

    def traj(history, admissible):
        steps = [Step(f"Action: {c}", c, c, "", False, False) for c in history]
        return Trajectory(games["pick_and_place_simple"], steps=steps, admissible=admissible)

    def policy(guard):
        return ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 24), reply="action",
                           action_space="admissible", loop_guard=guard)

    assert policy(2).commands(traj(["a", "b", "a"], ["a", "b", "c"])) == ["c"]
    assert policy(1).commands(traj(["a", "b", "a"], ["a", "b", "c"])) == ["b", "c"]
    assert policy(0).commands(traj(["a", "b", "a"], ["a", "b", "c"])) == ["a", "b", "c"]
    assert policy(2).commands(traj(["a", "b", "a"], ["a", "b"])) == ["a", "b"]  # every one would: all stay
    with pytest.raises(UserError, match="loop_guard needs sampling.action_space admissible"):
        ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 24), reply="action", loop_guard=1)


def test_a_guarded_rollout_never_repeats_and_stays_exact(tiny_model, tokenizer, games):
    """A real rollout under `loop_guard` 1 on a real game (every sample): no step's command is the
    previous one while another was admissible, the steps it narrowed are recorded (and survive the
    record), and the learner's teacher-forced log-probs still equal the sampler's (fp32, 1e-5)."""
    import copy

    from agentrl.config import LearnerConfig
    from agentrl.rollout.lockstep import ModelPolicy, run_lockstep
    from agentrl.rollout.trajectory import Trajectory, behaviour_metrics
    from agentrl.train.learner import LocalLearner

    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(0.0, 1.0, 24), seed=1, reply="action",
                         action_space="admissible", loop_guard=1)
    trajs = run_lockstep([games["pick_and_place_simple"]], policy, max_steps=6, group_size=2).trajectories
    for t in trajs:
        commands = [s.command for s in t.steps]
        assert all(c is not None for c in commands)
        assert all(b != a for a, b in zip(commands, commands[1:]))
        assert set(t.guarded_steps) <= set(range(1, len(t.steps)))
        assert Trajectory.from_json(t.to_json()).guarded_steps == t.guarded_steps
    metrics = behaviour_metrics(trajs)
    assert metrics["guarded_rate"] == pytest.approx(sum(map(len, (t.guarded_steps for t in trajs))) / sum(len(t.steps) for t in trajs), abs=1e-4)
    learner = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4))
    for t, logp in zip(trajs, learner._logprobs([(t, 1.0) for t in trajs])):
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        assert torch.allclose(logp[mask], torch.tensor(t.logprobs)[mask], atol=1e-5)


# ---------------------------------------------------------------- jump-forward (sampling/jump.py)
def test_take_forced_appends_what_every_alive_command_continues_with():
    """Commands [5 6 9], [5 7 9], [5 6 8 9] and a row whose one command [4 9] is forced to its end:
    the first row takes 5 and stops at the choice 6/7; the second takes 4 and 9 (its stop) and is
    done; a free row takes nothing. Taken tokens have log-prob 0."""
    from agentrl.sampling.decode import DecodeState
    from agentrl.sampling.jump import take_forced

    sets = [CommandSet(((5, 6, 9), (5, 7, 9), (5, 6, 8, 9))), CommandSet(((4, 9),)), None]
    state = DecodeState.start(torch.zeros((3, 12)), [0, 1, 2], [3, 3, 3], [1, 2, 3], 6, sets)
    state.logps.fill_(-1.0)
    t = torch.zeros(3, dtype=torch.long)
    assert take_forced(state, t, 6, torch.tensor([9])) == 3
    assert t.tolist() == [1, 2, 0]
    assert state.tokens[0, :1].tolist() == [5] and state.tokens[1, :2].tolist() == [4, 9]
    assert state.done.tolist() == [False, True, False] and state.length[1] == 2
    assert state.logps[0, 0] == 0.0 and state.logps[1, :2].tolist() == [0.0, 0.0] and state.logps[2, 0] == -1.0
    assert state.alive[0].tolist() == [True, True, True]
    assert take_forced(state, t, 6, torch.tensor([9])) == 0  # the first row's next token is a choice


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jump_forward_equals_the_token_loop(arch, tiny_model, tokenizer, temperature):
    """Constrained rows (commands that share prefixes, one set of a single command) beside a free
    row, two turns on the store's kept keys: the jump-forward loop writes every reply the token loop
    writes, log-probs within 1e-5 and equal to a teacher-forced forward restricted to the allowed ids;
    turn 2 equals a run without kept keys (a finished row's store holds only the keys it computed)."""
    from test_sampler import _tiny

    model = tiny_model if arch == "llama" else _tiny(arch, tokenizer)
    sets = [command_set(tokenizer), command_set(tokenizer, COMMANDS[2:6]), None, command_set(tokenizer, ["look"])]
    obs = tokenizer("You see a shelf 1 and a shelf 10.", add_special_tokens=False).input_ids
    params = SamplingParams(temperature, 1.0, 16)
    runs = {}
    for name, jump, keys in (("loop", False, True), ("jump", True, True), ("fresh", True, False)):
        sampler = HFSampler(model, tokenizer, static_decode="off", jump_forward=jump)
        turns, ps = [], prompts(tokenizer, 4)
        for turn in range(2):
            reqs = [GenRequest(p, seed=10 * turn + i, key=i if keys else None, constraint=c)
                    for i, (p, c) in enumerate(zip(ps, sets))]
            out = sampler.generate(reqs, params)
            turns += out
            ps = [p + o.token_ids + obs[: 4 + i] for i, (p, o) in enumerate(zip(ps, out))]
        runs[name] = (turns, sampler)
    for a, b, c in zip(runs["loop"][0], runs["jump"][0], runs["fresh"][0]):
        assert a.token_ids == b.token_ids == c.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5) and b.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    for o, cs in zip(runs["jump"][0], sets * 2):
        with torch.no_grad():
            logits = model(torch.tensor([o.prompt_ids + o.token_ids])).logits[0, len(o.prompt_ids) - 1 : -1].float()
        allowed = cs.allowed_along(o.token_ids) if cs else [list(range(logits.shape[-1]))] * len(o.token_ids)
        for t, (token, ids) in enumerate(zip(o.token_ids, allowed)):
            assert o.logprobs[t] == pytest.approx(float(logits[t, token] - torch.logsumexp(logits[t, ids], 0)), abs=1e-5)
    assert runs["jump"][1].forced_tokens > 0 and runs["loop"][1].forced_tokens == 0


def test_a_decided_reply_runs_no_forward(tiny_model, tokenizer):
    """Constrained rows decode in fewer forwards than their longest reply; a row whose command is
    the only one runs none: every token after the prefill's is taken as forced (log-prob 0)."""
    sampler = HFSampler(tiny_model, tokenizer, static_decode="off")
    only = sampler.generate([GenRequest(prompts(tokenizer, 1)[0], seed=1, constraint=command_set(tokenizer, ["look"]))],
                            SamplingParams(0.0, 1.0, 24))[0]
    assert sampler.decode_forwards == 0 and sampler.forced_tokens == len(only.token_ids) - 1
    assert only.logprobs == [0.0] * len(only.token_ids) and only.finish_reason == "stop"
    sets = [command_set(tokenizer), command_set(tokenizer, COMMANDS[:3])]
    out = sampler.generate([GenRequest(p, seed=i, constraint=c) for i, (p, c) in enumerate(zip(prompts(tokenizer, 2), sets))],
                           SamplingParams(1.0, 1.0, 24))
    assert 0 < sampler.decode_forwards < max(len(o.token_ids) for o in out) - 1
