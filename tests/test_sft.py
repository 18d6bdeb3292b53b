"""`agentrl sft` (the warm start) and `agentrl train --init-adapter`: the expert data is the
rollout token for token, SFT lowers held-out NLL, the sampler serves the warm start as v0,
resume from a warm start is exact, bad input is one line and exit 2. Real games from ../shared,
real PEFT adapters, the tiny Llama of conftest.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import TASK_TYPES, load_config
from agentrl.env.data import discover_games
from agentrl.train.sft import expert_dataset, lr_lambda, micro_batches, optimizer_steps, round_robin, run_sft, sft_prompt

REPO = Path(__file__).resolve().parents[1]


def sft_cfg(**overrides):
    base = {"env.workers": 0, "learner.lora_r": 4, "learner.lora_alpha": 8, "learner.target_modules": ["q_proj", "v_proj"],
            "sft.games": 2, "sft.heldout_games": 2, "sft.epochs": 3, "sft.lr": 1e-2, "sft.batch_games": 1}
    return sft_prompt(load_config(None, base | overrides))


def masked_runs(ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("admissible", [False, True])
def test_expert_dataset_is_the_rollout_token_for_token(tmp_path, games, tokenizer, admissible):
    """One masked reply per walkthrough step, each decoding to exactly `Action: <cmd>` and its
    end-of-turn token; the ids equal the chat template's rendering of the same conversation
    (system prompt, no example, the env's observations; with prompt.admissible each followed by
    the admissible commands), built here independently."""
    from agentrl.env import AlfworldEnv
    from agentrl.prompt import episode_messages

    cfg = sft_cfg(**{"prompt.admissible": admissible})

    def shown(result):
        if not admissible:
            return result.observation
        assert result.admissible
        return result.observation + "\nAdmissible actions: " + ", ".join(result.admissible) + "."

    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    data = expert_dataset(cfg, chosen, tokenizer, envs=None, cache_dir=tmp_path)
    assert not data.skipped and [e.game_id for e in data.examples] == [g.game_id for g in chosen]
    for game, example in zip(chosen, data.examples):
        runs = masked_runs(example.token_ids, example.action_mask)
        assert [tokenizer.decode(r) for r in runs] == [f"Action: {c}<|im_end|>" for c in game.walkthrough]
        env = AlfworldEnv(game)
        first = shown(env.reset())
        messages = episode_messages(game.task_type, first, example="none", reply="action")
        assert messages[0]["role"] == "system" and sum(m["role"] == "assistant" for m in messages) == 0  # no example
        for i, command in enumerate(game.walkthrough):
            messages.append({"role": "assistant", "content": f"Action: {command}"})
            step = env.step(command)
            if i < len(game.walkthrough) - 1:
                messages.append({"role": "user", "content": shown(step)})
        assert step.won
        env.close() if hasattr(env, "close") else None
        rendered = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
        assert rendered[: len(example.token_ids)] == example.token_ids
        assert tokenizer.decode(rendered[len(example.token_ids):]).strip() == ""  # the template's trailing newline


def test_recorded_replies_replay_verbatim_by_trajectory(tmp_path, games, tokenizer):
    """ExpertSampler with reply None (benchmarks/bench_context.py's replay of an eval): the replies
    are taken verbatim and looked up by the whole key (game, index), so two episodes of one game
    replay apart. Replies that are the taught ones give the expert data's ids exactly."""
    from agentrl.env import prompt_options
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    cfg = sft_cfg()
    game = games["pick_and_place_simple"]
    taught = tuple(f"Action: {c}" for c in game.walkthrough)
    other = ("Action: look", "I am not sure.") + taught  # episode 1: a no-op and an unparsable reply first
    sampler = ExpertSampler(tokenizer, {(game.game_id, 0): taught, (game.game_id, 1): other}, None)
    policy = ModelPolicy(sampler, SamplingParams(0.0, 1.0, 10_000), seed=0, **prompt_options(cfg))
    rollout = run_lockstep([game], policy, max_steps=len(other), group_size=2)
    first, second = rollout.trajectories
    expert = expert_dataset(cfg, [game], tokenizer, envs=None, cache_dir=tmp_path).examples[0]
    assert first.won and first.token_ids == expert.token_ids
    assert [s.response for s in second.steps] == list(other) and second.won
    assert [s.valid for s in second.steps[:2]] == [True, False]


@pytest.mark.parametrize("history", [1, 2])
def test_windowed_expert_data_is_what_the_policy_is_shown_token_for_token(tmp_path, games, tokenizer, history):
    """prompt.history N: one example per walkthrough step, its ids the chat template's rendering of
    the system prompt, the first observation (the task) and only the last N turns, then the taught
    reply: built here independently. The sampler is given the same ids at each step (recorded)."""
    from agentrl.env import AlfworldEnv
    from agentrl.prompt import episode_messages
    from agentrl.train import sft as sft_module

    cfg = sft_cfg(**{"prompt.history": history})
    game = games["pick_and_place_simple"]
    seen = []
    real = sft_module.ExpertSampler.generate

    def recording(self, requests, params):
        seen.extend(list(r.prompt_ids) for r in requests)
        return real(self, requests, params)

    sft_module.ExpertSampler.generate = recording
    try:
        data = expert_dataset(cfg, [game], tokenizer, envs=None, cache_dir=tmp_path)
    finally:
        sft_module.ExpertSampler.generate = real
    assert len(data.examples) == len(game.walkthrough) > history + 1  # windows do cut something here
    env = AlfworldEnv(game)
    opening = episode_messages(game.task_type, env.reset().observation, example="none", reply="action")
    turns = []  # (reply, the observation after it)
    for i, (command, example) in enumerate(zip(game.walkthrough, data.examples)):
        kept = [m for a, o in turns[max(0, i - history):] for m in
                ({"role": "assistant", "content": a}, {"role": "user", "content": o})]
        context = tokenizer(tokenizer.apply_chat_template(opening + kept, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False).input_ids
        reply = tokenizer(f"Action: {command}<|im_end|>", add_special_tokens=False).input_ids
        assert example.token_ids == context + reply, f"step {i}"
        assert example.action_mask == [0] * len(context) + [1] * len(reply)
        assert seen[i] == context  # what the sampler was asked to continue
        turns.append((f"Action: {command}", env.step(command).observation))


def test_bad_walkthroughs_are_reported_by_game_and_skipped(tmp_path, games, tokenizer, monkeypatch):
    good, short = games["pick_and_place_simple"], games["look_at_obj_in_light"]
    unwinnable = dataclasses.replace(short, walkthrough=short.walkthrough[:-1])
    broken_dir = tmp_path / "broken" / "trial"
    shutil.copytree(games["pick_heat_then_place_in_recep"].path.parent, broken_dir, copy_function=shutil.copyfile)
    (broken_dir / "game.tw-pddl").write_text("{ not a game")
    corrupt = dataclasses.replace(games["pick_heat_then_place_in_recep"], game_id="broken/trial",
                                  path=broken_dir / "game.tw-pddl")
    data = expert_dataset(sft_cfg(), [good, unwinnable, corrupt], tokenizer, envs=None, cache_dir=tmp_path / "cache")
    assert [e.game_id for e in data.examples] == [good.game_id]
    why = dict(data.skipped)
    assert set(why) == {unwinnable.game_id, corrupt.game_id}
    assert "did not win" in why[unwinnable.game_id] and why[corrupt.game_id]
    assert not list((tmp_path / "cache").glob("*.jsonl"))  # an env failure is never cached

    # a clean selection is cached: the second build replays no env and gives the same examples
    first = expert_dataset(sft_cfg(), [good, unwinnable], tokenizer, envs=None, cache_dir=tmp_path / "cache")
    import agentrl.rollout

    monkeypatch.setattr(agentrl.rollout, "run_lockstep", lambda *a, **k: pytest.fail("replayed an env on a cache hit"))
    second = expert_dataset(sft_cfg(), [good, unwinnable], tokenizer, envs=None, cache_dir=tmp_path / "cache")
    assert second.cached and not first.cached
    assert [e.__dict__ for e in second.examples] == [e.__dict__ for e in first.examples]
    assert second.skipped == first.skipped


def test_games_round_robin_over_task_types_and_batches_respect_the_token_budget(data_root):
    from agentrl.train.sft import Example

    train = discover_games("train", data_root)
    chosen = round_robin(train, 12)
    assert [g.task_type for g in chosen] == [t for t in TASK_TYPES if any(g.task_type == t for g in train)] * 2
    examples = [Example("g", "t", [1] * n, [1] * n) for n in (5, 300, 40, 41, 900, 7)]
    batches = micro_batches(examples, 100)
    assert sorted(len(e.token_ids) for b in batches for e in b) == sorted(len(e.token_ids) for e in examples)
    assert all(len(b) == 1 or len(b) * max(len(e.token_ids) for e in b) <= 100 for b in batches)
    assert [len(b) for b in batches] == [2, 2, 1, 1]  # (5, 7), (40, 41), 300, 900


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory, tiny_actor_dir, tokenizer, data_root):
    """A real `run_sft` of the tiny actor on two train walkthroughs (the module's adapter)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sft") / "warmstart"
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir)
    cfg = sft_cfg(**{"model.name": str(tiny_actor_dir), "data.root": str(data_root)})
    summary = run_sft(cfg, out, model=model, tokenizer=tokenizer, cache_dir=out.parent / "cache")
    return out, summary


def test_sft_lowers_heldout_nll_and_writes_a_standard_peft_adapter(warm_start, tiny_actor_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, summary = warm_start
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "agentrl.json",
                                               "sft_metrics.jsonl", "README.md"}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".warmstart")]  # no temporary left behind
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "dataset" and rows[0]["examples"] == 2 and rows[0]["heldout_examples"] == 2
    assert [r["epoch"] for r in rows[1:]] == [0, 1, 2, 3]
    before, after = rows[1]["heldout_nll"], rows[-1]["heldout_nll"]
    assert after < before - 0.1, (before, after)  # measured: 7.56 -> 7.23
    assert summary["heldout_nll"] == {"before": before, "after": after}
    record = json.loads((out / "agentrl.json").read_text())
    assert record["prompt"] == {"example": "none", "reply": "action", "admissible": False, "history": 0}
    assert record["machine"]["dtype"] == "float32" and record["machine"]["device"] == "cpu"  # what its bytes came from
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_actor_dir), out)  # loads unchanged
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)  # trained, not the zero init


def test_the_warm_start_reuses_the_heap_only_where_it_fits_and_learns_the_same(tmp_path, tiny_actor_dir, tokenizer,
                                                                              data_root, monkeypatch):
    """sft's steps run inside procmem.reused_heap() under the update's rule (learner.heap auto, the
    largest micro-batch's estimate times the heap's fragmentation within what is free); not where
    it does not fit, nor under learner.heap fixed; the same adapter to the bit either way."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl import procmem
    from agentrl.train import learner as learner_module, memory

    entered = []
    monkeypatch.setattr(learner_module, "reused_heap", lambda: entered.append(1) or procmem.reused_heap())
    arms = {}
    for name, heap, free in (("auto", "auto", 1 << 40), ("short", "auto", memory.RESERVE_BYTES + 1), ("fixed", "fixed", 1 << 40)):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device, free=free: free)
        entered.clear()
        out = tmp_path / name
        cfg = sft_cfg(**{"model.name": str(tiny_actor_dir), "data.root": str(data_root), "sft.epochs": 1,
                         "sft.heldout_games": 0, "learner.heap": heap})
        run_sft(cfg, out, model=AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer=tokenizer,
                cache_dir=tmp_path / "cache")
        arms[name] = (len(entered), load_file(out / "adapter_model.safetensors"))
    assert {name: n for name, (n, _) in arms.items()} == {"auto": 1, "short": 0, "fixed": 0}
    for name in ("short", "fixed"):
        assert arms[name][1].keys() == arms["auto"][1].keys()
        assert all(torch.equal(arms[name][1][k], v) for k, v in arms["auto"][1].items())


def test_the_adapters_prompt_is_used_unless_told_otherwise(warm_start):
    out, _ = warm_start
    cfg = load_config(None, {"model.adapter": str(out)})
    assert (cfg.prompt.example, cfg.prompt.reply) == ("none", "action")
    cfg = load_config(None, {"train.init_adapter": str(out), "prompt.example": "type"})
    assert (cfg.prompt.example, cfg.prompt.reply) == ("type", "action")
    assert (load_config().prompt.example, load_config().prompt.reply) in ((None, None), ("type", "react"))


class Recording:
    """The real sampler, recording what it generated (prompt, ids, log-probs) at each version."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests, params):
        out = self.inner.generate(requests, params)
        self.calls += [(self.inner.adapter_version, c) for c in out]
        return out


def test_init_adapter_is_served_as_version_0(tmp_path, warm_start, tiny_actor_dir, monkeypatch):
    """Iteration 0's greedy eval: the sampler's log-probs equal the warm start's loaded
    independently with PEFT (and differ from the base model's)."""
    import agentrl.sampling as sampling
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.train.loop import train
    from agentrl.train.prerun import prepare_run, start_run

    out, _ = warm_start
    real, made = sampling.make_sampler, []
    monkeypatch.setattr(sampling, "make_sampler", lambda *a, **k: made.append(Recording(real(*a, **k))) or made[-1])
    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2,
                             "train.init_adapter": str(out), "train.iterations": 0, "train.eval_tasks": 3,
                             "sampling.max_new_tokens": 12, "rollout.gate": "off"})
    run = tmp_path / "run"
    start_run(run, prepare_run(run, cfg, resume=False, force=False), force=False)
    train(cfg, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["iteration"], r["adapter_version"]) for r in rows] == [("eval", 0, 0)]
    (sampler,) = made
    calls = [c for v, c in sampler.calls if v == 0 and c.token_ids]
    assert calls and len(calls) == len(sampler.calls)
    warm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_actor_dir), out).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_actor_dir).eval()
    gap_base = 0.0
    for c in calls:
        ids = torch.tensor([list(c.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            for model, is_warm in ((warm, True), (base, False)):
                logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1:-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                if is_warm:
                    assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4), (lp, c.logprobs)
                else:
                    gap_base = max(gap_base, float((lp - torch.tensor(c.logprobs)).abs().max()))
    assert gap_base > 1e-3  # the warm start really changed the policy


def test_the_curve_starts_at_the_base_model_and_iteration_0s_evals_are_cached(tmp_path, warm_start, tiny_actor_dir,
                                                                                 monkeypatch):
    """train.eval_base: the base model (no adapter loaded yet) is evaluated on the held-out games,
    then the warm start as version 0 on the same games; train.eval_cache keeps both, so a second
    run of the same warm start reads them (cached, same outcomes) and runs no episode before its
    first rollout; the report shows base -> warm start -> iteration 1."""
    import agentrl.sampling as sampling

    from agentrl.report import build_report
    from agentrl.cli.display import phase_label
    from agentrl.train.loop import Hooks, train
    from agentrl.train.prerun import prepare_run, start_run

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    out, _ = warm_start
    real, made = sampling.make_sampler, []
    monkeypatch.setattr(sampling, "make_sampler", lambda *a, **k: made.append(Recording(real(*a, **k))) or made[-1])
    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2,
                             "train.init_adapter": str(out), "train.iterations": 1, "train.eval_tasks": 3,
                             "train.eval_base": True, "train.eval_cache": True, "rollout.tasks": 2,
                             "rollout.group_size": 2, "sampling.max_new_tokens": 12, "rollout.gate": "off"})

    phases = []

    def run_once(name):
        run = tmp_path / name
        start_run(run, prepare_run(run, cfg, resume=False, force=False), force=False)
        train(cfg, run, hooks=Hooks(phase=lambda name, total=None, iteration=0: phases.append(phase_label(name, iteration, 1))))
        return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    first, rows = run_once("first")
    assert phases[:3] == ["eval base model", "eval it 0", "rollout it 1/1"]  # the progress bar says which eval runs
    assert [(r["kind"], r["iteration"]) for r in rows] == [("base_eval", 0), ("eval", 0), ("iteration", 1), ("eval", 1)]
    base, warm = rows[0], rows[1]
    assert base["weights"] == "base" and warm["weights"].startswith("adapter-") and base["eval_key"] != warm["eval_key"]
    assert set(base["outcomes"]) == set(warm["outcomes"]) and len(base["outcomes"]) == 3
    assert not base.get("cached") and not warm.get("cached")
    versions = [v for v, _ in made[0].calls]
    n_base = versions.index(0)  # the base model's episodes came first, with no adapter loaded
    assert n_base > 0 and set(versions[:n_base]) == {None}
    assert len(list((tmp_path / "cache" / "evals").glob("*.json"))) == 2

    second, again = run_once("second")
    assert [(r["kind"], r.get("cached")) for r in again[:2]] == [("base_eval", True), ("eval", True)]
    assert [r["outcomes"] for r in again[:2]] == [base["outcomes"], warm["outcomes"]]
    assert made[1].calls and made[1].calls[0][0] == 0  # no base-model episode ran: the first generate is the rollout's

    (r,) = build_report([second], tmp_path / "report")["runs"]
    assert [c["what"] for c in r["curve"]] == ["base model", "iteration 0 (warm start)", "iteration 1"]
    assert r["warm_start_verdict"].startswith("held-out success, base model -> warm start (iteration 0)")


def test_resume_from_a_warm_start_equals_an_uninterrupted_run(tmp_path, warm_start, tiny_actor_dir, monkeypatch):
    from safetensors.torch import load_file

    import agentrl.sampling as sampling
    from scripted import ScriptedSampler

    from agentrl.train.loop import train
    from agentrl.train.prerun import prepare_run, start_run

    real, made = sampling.make_sampler, []
    monkeypatch.setattr(sampling, "make_sampler", lambda *a, **k: made.append(ScriptedSampler(real(*a, **k), ("split",))) or made[-1])
    out, _ = warm_start

    def cfg(iterations):
        return load_config(None, {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2,
                                  "env.fuzzy_threshold": 0.0, "rollout.gate": "off", "rollout.tasks": 2,
                                  "rollout.group_size": 3, "sampling.temperature": 1.0, "sampling.max_new_tokens": 32,
                                  "learner.lr": 1e-2, "train.init_adapter": str(out), "train.iterations": iterations,
                                  "train.eval_tasks": 0, "seed": 5})

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    start_run(straight, prepare_run(straight, cfg(2), resume=False, force=False), force=False)
    train(cfg(2), straight)
    start_run(resumed, prepare_run(resumed, cfg(1), resume=False, force=False), force=False)
    train(cfg(1), resumed)
    c = prepare_run(resumed, None, resume=True, force=False, overrides={"train.iterations": 2})
    assert c.train.init_adapter == str(out)
    train(c, resumed, resume=True)

    def its(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = its(straight), its(resumed)
    assert len(made) == 3 and all(s.scripted > 0 for s in made)
    assert [r["adapter_version"] for r in a] == [1, 2] and all(r["step_tokens_trained"] > 0 for r in a)
    keys = ("loss", "grad_l2_norm", "train_reward", "step_tokens_generated", "step_tokens_trained")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    wa = load_file(str(straight / "checkpoints" / "it00002" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "it00002" / "adapter" / "adapter_model.safetensors"))
    w0 = load_file(str(out / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert {k.replace(".default", "") for k in wa} == {k.replace(".default", "") for k in w0}  # the warm start's LoRA, continued
    starts = [json.loads(line) for line in (resumed / "machine.jsonl").read_text().splitlines()]  # one line per start
    assert [s["resume"] for s in starts] == [False, True] and {s["dtype"] for s in starts} == {"float32"}
    # every adapter the run wrote carries the warm start's prompt, so evaluating one uses it (a bug once:
    # adapters/vN had no agentrl.json and were evaluated with the ReAct prompt and its example)
    for adapter in (straight / "adapters" / "v2", straight / "checkpoints" / "it00002" / "adapter",
                    resumed / "adapters" / "v2", resumed / "checkpoints" / "it00002" / "adapter"):
        record = json.loads((adapter / "agentrl.json").read_text())
        assert record["prompt"] == {"example": "none", "reply": "action", "admissible": False, "history": 0}, adapter
        evaluated = load_config(None, {"model.adapter": str(adapter)})
        assert (evaluated.prompt.example, evaluated.prompt.reply) == ("none", "action")
    # what an eval's summary.json names as the bytes it evaluated: equal for the two runs' equal weights
    from agentrl.weights import weights_digest
    digest = weights_digest(straight / "adapters" / "v2")
    assert digest == weights_digest(resumed / "adapters" / "v2") == {
        "adapter_model.safetensors": hashlib.sha256((straight / "adapters" / "v2" / "adapter_model.safetensors").read_bytes()).hexdigest()}
    assert digest != weights_digest(out)


def agentrl(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_bad_input_is_one_line_and_exit_2_and_nothing_is_written(tmp_path, warm_start, tiny_actor_dir):
    out, _ = warm_start
    not_lora = tmp_path / "not-lora"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    from safetensors.torch import save_file

    save_file({"prompt_embeddings": torch.zeros(4, 64)}, str(not_lora / "adapter_model.safetensors"))
    cases = [
        (["train", "--out", str(tmp_path / "r1"), "--init-adapter", str(tmp_path / "missing")], "r1", "adapter"),
        (["train", "--out", str(tmp_path / "r2"), "--init-adapter", str(not_lora)], "r2", "LoRA"),
        (["train", "--out", str(tmp_path / "r3"), "--init-adapter", str(out)], "r3", "does not fit"),  # tiny adapter, default model
        (["sft", "--out", str(tmp_path / "s1"), "--epochs", "0"], "s1", "sft.epochs"),
        (["sft", "--out", str(tmp_path / "s2"), "--games", "0"], "s2", "sft.games"),
        (["sft", "--out", str(tmp_path / "s4"), "--lora-r", "-2"], "s4", "learner.lora_r must be >= 0"),
        (["sft", "--out", str(tmp_path / "s3"), "--data", str(tmp_path / "empty")], "s3", "not found"),
    ]
    (tmp_path / "empty" / "json_2.1.1" / "valid_seen").mkdir(parents=True)  # a data root without train games
    for args, written, needle in cases:
        p = agentrl(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        err = p.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err and needle in err, (args, err)
        assert not (tmp_path / written).exists()


@pytest.mark.parametrize("packed", [True, False])
def test_masked_nll_is_the_teacher_forced_nll_of_the_replies(tiny_model, packed):
    """The loss's reply-only vocabulary projection equals the full teacher-forced log-probs of
    each example on its own, packed in one row or padded in two."""
    from agentrl.train.loss import token_logprobs
    from agentrl.train.packing import pack
    from agentrl.train.sft import Example, masked_nll_sum

    g = torch.Generator().manual_seed(0)
    batch = [Example("a", "t", torch.randint(0, 1000, (n,), generator=g).tolist(), [0] * (n - 4) + [1] * 4)
             for n in (9, 14)]
    batch[1].action_mask[3:6] = [1, 1, 1]
    rows = [[0, 1]] if packed else [[0], [1]]
    nll, n = masked_nll_sum(tiny_model, pack([e.token_ids for e in batch], rows, "cpu", packed), [e.action_mask for e in batch])
    with torch.no_grad():
        want = sum(-(token_logprobs(tiny_model, torch.tensor([e.token_ids]), torch.ones(1, len(e.token_ids), dtype=torch.long))[0]
                     * torch.tensor(e.action_mask)).sum() for e in batch)
    assert n == 11 and torch.allclose(nll.detach(), want, rtol=1e-5)


def test_a_warm_start_is_reused_only_for_the_same_recipe(warm_start, tiny_actor_dir, data_root):
    """`agentrl sft --reuse` (what `make train` runs) keeps DIR only if it was built with this recipe."""
    from agentrl.train.sft import reusable

    out, summary = warm_start
    same = sft_cfg(**{"model.name": str(tiny_actor_dir), "data.root": str(data_root)})
    assert reusable(same, out) == json.loads((out / "agentrl.json").read_text()) and summary["recipe"]
    assert reusable(sft_cfg(**{"model.name": str(tiny_actor_dir), "data.root": str(data_root),
                               "sft.checkpoint_minutes": 0.0}), out)  # how often it is kept is not the recipe
    for change in ({"sft.epochs": 4}, {"learner.lora_r": 8}, {"seed": 1}, {"sft.games": 3}):
        assert reusable(sft_cfg(**{"model.name": str(tiny_actor_dir), "data.root": str(data_root)} | change), out) is None
    assert reusable(same, out.parent / "nothing-here") is None


def test_optimizer_steps_group_micro_batches_up_to_batch_games():
    order = [["a"], ["b", "c"], ["d"], ["e"], ["f", "g"]]
    assert optimizer_steps(order, 1) == [[b] for b in order]  # one micro-batch per step
    assert optimizer_steps(order, 2) == [[["a"], ["b", "c"]], [["d"], ["e"]], [["f", "g"]]]
    assert optimizer_steps(order, 10) == [order]  # the last step takes what is left


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    s = dataclasses.replace(load_config().sft, warmup=0.1, schedule="cosine", min_lr_ratio=0.1)
    f = lr_lambda(s, 100)
    assert [f(n) for n in range(10)] == pytest.approx([(n + 1) / 10 for n in range(10)])  # 10 warm-up steps
    assert f(10) == pytest.approx(1.0) and f(99) == pytest.approx(0.1)  # peak after the warm-up, floor at the last step
    assert f(10 + 89 // 2) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (89 // 2) / 89)))
    assert all(f(n) >= f(n + 1) for n in range(10, 99))  # decays monotonically
    constant = lr_lambda(dataclasses.replace(s, schedule="constant", warmup=0.0), 100)
    assert {constant(n) for n in range(100)} == {1.0}



def _sft_yaml(tmp_path: Path, tiny_actor_dir, data_root, **sft) -> Path:
    """sft_cfg's settings as a config file, for `agentrl sft` in a process of its own."""
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "model": {"name": str(tiny_actor_dir)}, "data": {"root": str(data_root)}, "env": {"workers": 0},
        "learner": {"lora_r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "sft": {"games": 2, "heldout_games": 2, "epochs": 3, "lr": 1e-2, "batch_games": 1} | sft}))
    return path


@pytest.mark.parametrize("killed_in", [4, 5])  # mid-epoch (epoch 2's second step), and at an epoch's end
def test_a_killed_warm_start_continues_from_its_checkpoint_and_equals_an_uninterrupted_one(
        tmp_path, warm_start, tiny_actor_dir, data_root, killed_in):
    """`agentrl sft` SIGKILLed in optimizer step 4 or 5 of 6 (AGENTRL_FAULT: the process really kills
    itself there), checkpoints every step: the same command again continues at the step before (the LoRA,
    AdamW, the lr schedule and the RNG restored, the batch order drawn again) and writes the
    adapter an uninterrupted run wrote (the module's warm start, the same settings in this
    process), bit for bit; OUT.partial/ goes once OUT is written."""
    import os

    from safetensors.torch import load_file

    out = tmp_path / "ws"
    config = _sft_yaml(tmp_path, tiny_actor_dir, data_root, checkpoint_minutes=0)
    env = os.environ | {"AGENTRL_FAULT": f"kill:update@{killed_in}"}
    killed = subprocess.run([sys.executable, "-m", "agentrl.cli", "sft", "--config", str(config), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and (tmp_path / "ws.partial" / "checkpoints" / "latest").read_text().strip() == f"step{killed_in - 1:06d}"
    again = agentrl("sft", "--config", str(config), "--out", str(out))
    assert again.returncode == 0, again.stderr
    shown = " ".join((again.stdout + again.stderr).split())  # (the progress bar's lines go to stderr, wrapped)
    assert "continuing" in shown and f"at step {killed_in - 1} of 6" in shown, shown
    assert not (tmp_path / "ws.partial").exists()
    straight, _ = warm_start
    a = load_file(str(out / "adapter_model.safetensors"))
    b = load_file(str(straight / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (straight / "sft_metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["heldout_nll"], r["train_nll"]) for r in rows[1:]] == \
        [(r["epoch"], r["heldout_nll"], r["train_nll"]) for r in want[1:]]
    assert json.loads((out / "agentrl.json").read_text())["sft"]["resumed_at_steps"] == [killed_in - 1]


def test_an_unfinished_warm_start_of_another_recipe_is_refused_unless_discarded(tmp_path, tiny_actor_dir, tokenizer,
                                                                                 data_root):
    """A full disk in step 2 (ENOSPC, in this process) leaves step 1's checkpoint: a run with
    another lr is refused in one line naming the setting, and --no-resume (resume False) or
    --force discards the checkpoint and starts over."""
    import os

    from transformers import AutoModelForCausalLM

    from agentrl.errors import UserError
    from agentrl.train.sft import unfinished

    out = tmp_path / "ws"
    base = {"model.name": str(tiny_actor_dir), "data.root": str(data_root), "sft.checkpoint_minutes": 0.0,
            "sft.epochs": 1, "sft.heldout_games": 0}

    def run(resume=True, force=False, **change):
        model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir)
        return run_sft(sft_cfg(**base | change), out, force=force, model=model, tokenizer=tokenizer,
                       cache_dir=tmp_path / "cache", resume=resume)

    os.environ["AGENTRL_FAULT"] = "enospc:update@2"
    try:
        with pytest.raises(OSError):
            run()
    finally:
        del os.environ["AGENTRL_FAULT"]
    assert unfinished(out).name == "step000001"
    with pytest.raises(UserError, match=r"another recipe \(sft\.lr 0\.01 -> 0\.02\), at step 1 of 2"):
        run(**{"sft.lr": 2e-2})
    assert unfinished(out).name == "step000001"  # refused: kept
    summary = run(resume=False)
    assert "resumed_at_steps" not in summary["sft"] and unfinished(out) is None and out.is_dir()


def test_many_skipped_games_are_counted_in_one_line(caplog):
    """Past the first ten, skipped games are not named one by one: one line counts them by reason."""
    import logging

    from agentrl.train.sft import SKIP_WARNINGS, warn_skipped

    skipped = [(f"g{i}", "the expert did not win the game (ended max_steps after 50 steps)") for i in range(30)]
    skipped += [(f"h{i}", "no walkthrough") for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="agentrl.train.sft"):
        warn_skipped(skipped)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == SKIP_WARNINGS + 1
    assert lines[-1] == ("35 games skipped in all (25 more than named above): "
                         "30 the expert did not win the game; 5 no walkthrough")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentrl.train.sft"):
        warn_skipped(skipped[:3])
    assert len(caplog.records) == 3
