"""Full fine-tuning (learner.lora_r 0): every weight trains in fp32; `agentrl sft` writes a model
directory (kind "full") that eval, the sampler and `agentrl train --init-adapter` take; the hf
sampler swaps the new weights in place (every parameter keeps its storage) and then samples what
the learner's weights teacher-force; checkpoints continue exactly; bad directories are one line.
The tiny Llama of conftest.py, real PEFT, real games for the warm start."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import LearnerConfig, load_config
from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.rollout.trajectory import Trajectory
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.train.learner import LocalLearner
from agentrl.weights import WeightsRef, weights_kind
from scripted import rows

GAME = Game("task/trial", "train", "pick_and_place_simple", None)


def full_cfg(**kw) -> LearnerConfig:
    return LearnerConfig(**({"lora_r": 0, "lr": 1e-3, "micro_batch": 2} | kw))


@pytest.fixture
def trajectories(tiny_model, tokenizer):
    """Three sampled replies to one prompt, with the sampler's log-probs."""
    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    prompt = tokenizer("Thought: find the mug\nAction:", add_special_tokens=False).input_ids
    out = []
    for i, seed in enumerate((1, 2, 3)):
        c = sampler.generate(rows([prompt], seeds=[seed]), SamplingParams(1.0, 1.0, 6))[0]
        t = Trajectory(game=GAME, index=i)
        t.append(prompt, generated=False)
        t.append(c.token_ids, generated=True, logprobs=c.logprobs)
        out.append(t)
    return out


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def teacher_forced(model, prompt, completion) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_lora_r_0_trains_every_parameter_in_fp32(tiny_model, trajectories):
    """The plain model (no PEFT), every parameter in the optimizer, fp32 master weights even when
    handed a bf16 model; one update with a non-zero advantage moves every parameter tensor."""
    learner = LocalLearner(copy.deepcopy(tiny_model).to(torch.bfloat16), full_cfg())
    assert learner.kind == "full" and type(learner.model) is type(tiny_model)
    assert len(learner.params) == len(list(tiny_model.parameters()))
    assert all(p.dtype == torch.float32 and p.requires_grad for p in learner.model.parameters())
    before = weights_of(learner.model)
    stats = learner.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    assert stats.stepped and stats.grad_l2_norm > 0
    unchanged = [n for n, p in learner.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


def test_the_sampler_gap_starts_at_zero_and_the_kl_reference_is_the_start(tiny_model, trajectories):
    """Before the update the learner scores the sampler's replies as the sampler did; with a KL
    penalty the reference is a frozen copy of the starting weights (its KL is 0 on the first step)."""
    learner = LocalLearner(copy.deepcopy(tiny_model), full_cfg(kl_coef=0.1))
    start = weights_of(learner.model)
    stats = learner.update([(t, a) for t, a in zip(trajectories, (1.0, -1.0, 0.5))])
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-5
    assert stats.kl == pytest.approx(0.0, abs=1e-6)
    params = dict(learner.model.named_parameters())
    assert all(torch.equal(r, start[n]) for r, n in zip(learner.reference, params))  # the reference stays put
    assert stats.stepped and learner.update([(trajectories[0], 1.0), (trajectories[2], -1.0)]).kl > 0


@pytest.mark.parametrize("static_decode", ["off", "on"])
def test_a_full_swap_changes_the_samplers_outputs_in_place(tiny_model, tokenizer, trajectories, tmp_path, static_decode):
    """The issue's test: a swap changes the sampler's outputs and keeps every parameter's storage
    (data_ptr); the completions carry the new version and their log-probs are a teacher-forced
    forward of the learner's fp32 weights (1e-5). Also from a merged LoRA adapter to full weights."""
    from peft import LoraConfig, get_peft_model

    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer, static_decode=static_decode)
    ptrs = {n: p.data_ptr() for n, p in sampler.model.named_parameters()}
    prompts = [trajectories[0].token_ids[:5], trajectories[1].token_ids[:7]]
    greedy = SamplingParams(0.0, 1.0, 6)
    base = sampler.generate(rows(prompts), greedy)

    learner = LocalLearner(copy.deepcopy(tiny_model), full_cfg(lr=5e-2))
    learner.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    ref = learner.save(tmp_path / "adapters")
    assert ref.kind == "full" and weights_kind(ref.path) == "full" and Path(ref.path).name == "v1"
    sampler.load(ref)
    assert {n: p.data_ptr() for n, p in sampler.model.named_parameters()} == ptrs
    for params in (greedy, SamplingParams(1.0, 1.0, 6)):
        out = sampler.generate(rows(prompts, seeds=[4, 5]), params)
        assert [c.adapter_version for c in out] == [1, 1]
        for c in out:
            want = teacher_forced(learner.model, c.prompt_ids, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-5)
    assert [c.logprobs for c in sampler.generate(rows(prompts), greedy)] != [c.logprobs for c in base]

    # a sampler serving a merged LoRA adapter: restored to its base, unwrapped, then the full weights
    lora = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "lora")
    other = HFSampler(copy.deepcopy(tiny_model), tokenizer, static_decode=static_decode)
    other_ptrs = {n: p.data_ptr() for n, p in other.model.named_parameters()}
    other.load(WeightsRef(tmp_path / "lora", 1))
    other.load(WeightsRef(ref.path, 2, "full"))
    assert not other._lora_layers() and {n: p.data_ptr() for n, p in other.model.named_parameters()} == other_ptrs
    c = other.generate(rows(prompts[:1]), greedy)[0]
    assert c.adapter_version == 2
    assert torch.allclose(torch.tensor(c.logprobs), teacher_forced(learner.model, c.prompt_ids, c.token_ids), atol=1e-5)
    with pytest.raises(UserError, match="serves full weights"):  # a LoRA applies to a base no longer resident
        other.load(WeightsRef(tmp_path / "lora", 3))


def test_a_directory_that_does_not_fit_changes_nothing(tiny_model, tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    sampler = HFSampler(copy.deepcopy(tiny_model), tokenizer)
    before = weights_of(sampler.model)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(UserError, match="do not fit the model") as e:
        sampler.load(WeightsRef.of(tmp_path / "small", 1))
    assert len(str(e.value).splitlines()) == 1
    assert all(torch.equal(p, before[n]) for n, p in sampler.model.named_parameters())
    assert sampler.adapter_version is None and not sampler.serves_full
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "config.json").write_text("{}")
    for bad in (tmp_path / "neither", tmp_path / "missing"):
        with pytest.raises(UserError, match="full model directory") as e:
            weights_kind(bad)
        assert len(str(e.value).splitlines()) == 1


def test_save_and_load_state_continue_exactly(tiny_model, trajectories, tmp_path):
    """Weights + AdamW moments + RNG round-trip: a learner restored from a state takes the next
    step to the same weights, bit for bit, as the one that wrote it."""
    a = LocalLearner(copy.deepcopy(tiny_model), full_cfg(kl_coef=0.05))
    a.update([(trajectories[0], 1.0), (trajectories[1], -1.0)])
    a.save(tmp_path / "adapters")
    (tmp_path / "state").mkdir()
    a.save_state(tmp_path / "state")
    assert weights_kind(tmp_path / "state" / "adapter") == "full"
    b = LocalLearner(copy.deepcopy(tiny_model), full_cfg(kl_coef=0.05))
    ref = b.load_state(tmp_path / "state", 1)
    assert (ref.kind, ref.version, b.version) == ("full", 1, 1)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    for learner in (a, b):
        learner.update([(trajectories[2], 1.0), (trajectories[0], -0.5)])
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    lora = LocalLearner(copy.deepcopy(tiny_model), LearnerConfig(lora_r=4, target_modules=["q_proj"]))
    with pytest.raises(UserError, match="holds full weights"):
        lora.load_state(tmp_path / "state", 1)


def test_the_memory_estimate_counts_fp32_weights_gradients_moments_and_the_reference(tiny_actor_dir, tiny_model):
    from agentrl.train import memory

    n = sum(p.numel() for p in tiny_model.parameters())
    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "learner.lora_r": 0})
    assert memory.train_state_bytes(cfg, tiny_model.config) == (4 * n, 12 * n)
    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "learner.lora_r": 0, "learner.kl_coef": 0.1,
                             "train.init_adapter": str(tiny_actor_dir)})
    assert memory.train_state_bytes(cfg, tiny_model.config) == (4 * n, 16 * n)
    m = memory.learner_memory(cfg, 30)
    assert m.weights == 4 * n and m.train_state == 16 * n


# ---------------------------------------------------------------- the warm start and the trainer
@pytest.fixture(scope="module")
def full_warm_start(tmp_path_factory, tiny_actor_dir, tokenizer, data_root):
    """A real `run_sft` of the tiny actor with learner.lora_r 0 on two train walkthroughs."""
    from transformers import AutoModelForCausalLM

    from agentrl.train.sft import run_sft, sft_prompt

    out = tmp_path_factory.mktemp("sft-full") / "warmstart"
    cfg = sft_prompt(load_config(None, {"env.workers": 0, "learner.lora_r": 0, "sft.games": 2, "sft.heldout_games": 2,
                                        "sft.epochs": 2, "sft.lr": 1e-3, "model.name": str(tiny_actor_dir),
                                        "data.root": str(data_root)}))
    summary = run_sft(cfg, out, model=AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer=tokenizer,
                      cache_dir=out.parent / "cache")
    return out, summary


def test_sft_with_lora_r_0_writes_a_model_directory_that_eval_serves(full_warm_start, tiny_actor_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from agentrl.evaluate import run_eval, summary as eval_summary

    out, summary = full_warm_start
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "agentrl.json", "sft_metrics.jsonl", "tokenizer.json"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"} and weights_kind(out) == "full"
    assert summary["weights"] == "full" and summary["heldout_nll"]["after"] < summary["heldout_nll"]["before"]
    trained, base = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(tiny_actor_dir)
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))  # every weight trained

    sampler = HFSampler(AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer, adapter=str(out))
    assert sampler.serves_full and sampler.adapter_version == 0
    c = sampler.generate(rows([tokenizer("Action:", add_special_tokens=False).input_ids]), SamplingParams(0.0, 1.0, 5))[0]
    assert torch.allclose(torch.tensor(c.logprobs), teacher_forced(trained.eval(), c.prompt_ids, c.token_ids), atol=1e-5)

    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "model.adapter": str(out), "env.kind": "synthetic",
                             "env.workers": 0, "eval.limit": 2, "eval.max_steps": 1, "sampling.max_new_tokens": 8})
    assert (cfg.prompt.example, cfg.prompt.reply) == ("none", "action")  # the warm start's prompt, from its agentrl.json
    result = run_eval(cfg)
    assert len(result.trajectories) == 2 and all(t.adapter_versions == [0] for t in result.trajectories)
    assert eval_summary(result, cfg)["adapter_sha256"] == {  # the bytes it evaluated, as sha256sum prints them
        "model.safetensors": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}


def test_a_full_warm_starts_recipe_leaves_out_the_lora_settings_it_never_reads(full_warm_start, tiny_actor_dir,
                                                                              data_root):
    """Full fine-tuning records no LoRA α, dropout or target modules, so changing them keeps
    `--reuse`; a record written with them (before they were left out) is still the same recipe,
    and so is an unfinished warm start's checkpoint (`resumable` compares the same way)."""
    from agentrl.train.sft import comparable, reusable

    out, summary = full_warm_start
    assert summary["recipe"]["lora"] == {"r": 0, "weight_decay": load_config().learner.weight_decay}
    base = {"env.workers": 0, "learner.lora_r": 0, "sft.games": 2, "sft.heldout_games": 2, "sft.epochs": 2,
            "sft.lr": 1e-3, "model.name": str(tiny_actor_dir), "data.root": str(data_root)}
    assert reusable(load_config(None, base | {"learner.lora_alpha": 3, "learner.lora_dropout": 0.3}), out)
    assert reusable(load_config(None, base | {"learner.weight_decay": 0.5}), out) is None  # that one it reads
    old = json.loads((out / "agentrl.json").read_text())
    old["recipe"]["lora"] |= {"alpha": 64, "dropout": 0.05, "target_modules": ["q_proj"]}  # as written before
    assert comparable(old["recipe"]) == summary["recipe"]
    lora = {**summary["recipe"], "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]}}
    assert comparable(lora) == lora  # a LoRA recipe is compared whole


def test_train_from_a_full_warm_start_resumes_exactly(tmp_path, full_warm_start, tiny_actor_dir, monkeypatch):
    """`agentrl train` with learner.lora_r 0 from the full warm start, with a KL penalty: 2 iterations
    straight equal 1 + resume to 2 (losses, norms, rewards, tokens, the weights to the bit); the
    sampler serves v0 = the warm start, then each version; keep_adapters 1 keeps only the last."""
    from safetensors.torch import load_file

    import agentrl.sampling as sampling
    from scripted import ScriptedSampler

    from agentrl.train.loop import train
    from agentrl.train.prerun import prepare_run, start_run

    real, made = sampling.make_sampler, []
    monkeypatch.setattr(sampling, "make_sampler", lambda *a, **k: made.append(ScriptedSampler(real(*a, **k), ("split",))) or made[-1])
    out, _ = full_warm_start

    def cfg(iterations):
        return load_config(None, {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 2,
                                  "env.fuzzy_threshold": 0.0, "rollout.gate": "off", "rollout.tasks": 2,
                                  "rollout.group_size": 3, "sampling.temperature": 1.0, "sampling.max_new_tokens": 32,
                                  "learner.lora_r": 0, "learner.lr": 1e-3, "learner.kl_coef": 0.05,
                                  "train.init_adapter": str(out), "train.iterations": iterations,
                                  "train.keep_adapters": 1, "train.eval_tasks": 0, "seed": 5})

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    start_run(straight, prepare_run(straight, cfg(2), resume=False, force=False), force=False)
    train(cfg(2), straight)
    start_run(resumed, prepare_run(resumed, cfg(1), resume=False, force=False), force=False)
    train(cfg(1), resumed)
    train(prepare_run(resumed, None, resume=True, force=False, overrides={"train.iterations": 2}), resumed, resume=True)

    def its(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = its(straight), its(resumed)
    assert len(made) == 3 and all(s.scripted > 0 for s in made)
    assert [r["adapter_version"] for r in a] == [1, 2] and all(r["step_tokens_trained"] > 0 for r in a)
    assert [r["rollout_adapter_versions"] for r in a] == [[0], [1]]
    keys = ("loss", "grad_l2_norm", "train_reward", "step_tokens_generated", "step_tokens_trained", "kl_to_warm_start")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert a[0]["logprob_gap"] < 1e-4  # v0 served = the learner's start (the warm start, fp32)
    assert a[0]["kl_to_warm_start"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
    assert a[1]["kl_to_warm_start"] > 0
    assert sorted(p.name for p in (straight / "adapters").iterdir()) == ["v2"]  # keep_adapters prunes full versions
    wa = load_file(str(straight / "checkpoints" / "it00002" / "adapter" / "model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "it00002" / "adapter" / "model.safetensors"))
    w0 = load_file(str(out / "model.safetensors"))
    assert wa.keys() == wb.keys() == w0.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(not torch.equal(wa[k], w0[k]) for k in ("model.norm.weight", "model.embed_tokens.weight"))
    served = load_file(str(straight / "adapters" / "v2" / "model.safetensors"))
    assert all(torch.equal(served[k], wa[k]) for k in wa)
    assert json.loads((straight / "adapters" / "v2" / "agentrl.json").read_text())["weights"] == "full"


def agentrl(*args):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=600)


def test_bad_input_is_one_line_and_exit_2(tmp_path, full_warm_start, tiny_actor_dir):
    out, _ = full_warm_start
    (tmp_path / "neither").mkdir()
    cases = [
        (["eval", "--model", str(tiny_actor_dir), "--adapter", str(tmp_path / "neither"), "--out", str(tmp_path / "e1")],
         "e1", "nor a full model directory"),
        (["train", "--model", str(tiny_actor_dir), "--init-adapter", str(out), "--out", str(tmp_path / "r1")],
         "r1", "learner.lora_r 16 trains a LoRA"),  # the default rank cannot continue full weights
        (["train", "--init-adapter", str(out), "--out", str(tmp_path / "r2"), "--sampler", "vllm", "--lora-r", "0"],
         "r2", "needs --sampler hf"),  # the flag sets learner.lora_r as the config file does
        (["train", "--init-adapter", str(out), "--out", str(tmp_path / "r3"), "--config", str(write_config(tmp_path))],
         "r3", "do not fit 'default'"),  # the tiny model's weights, the default model
    ]
    for args, written, needle in cases:
        p = agentrl(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        err = p.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err and needle in err, (args, err)
        assert not (tmp_path / written).exists()


def write_config(tmp_path) -> Path:
    path = tmp_path / "full.yaml"
    path.write_text("learner:\n  lora_r: 0\n")
    return path


def test_a_killed_full_fine_tuning_warm_start_continues_to_the_same_weights(tmp_path, full_warm_start, tiny_actor_dir,
                                                                             data_root):
    """`agentrl sft` with learner.lora_r 0 SIGKILLed in optimizer step 2 of 4 (AGENTRL_FAULT),
    checkpointing every step (every weight and AdamW's state): the same command continues at step
    1 and writes the uninterrupted run's weights (the module's full warm start) bit for bit. The
    command runs under mimalloc on Linux (procmem.py), the in-process warm start on glibc: the
    allocator changes no number."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    out, config = tmp_path / "ws", tmp_path / "full.yaml"
    config.write_text(json.dumps({"model": {"name": str(tiny_actor_dir)}, "data": {"root": str(data_root)},
                                  "env": {"workers": 0}, "learner": {"lora_r": 0},
                                  "sft": {"games": 2, "heldout_games": 2, "epochs": 2, "lr": 1e-3, "checkpoint_minutes": 0}}))
    command = [sys.executable, "-m", "agentrl.cli", "sft", "--config", str(config), "--out", str(out)]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=os.environ | {"AGENTRL_FAULT": "kill:update@2"})
    assert killed.returncode == -9 and not out.exists(), killed.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in os.environ.items() if k != "AGENTRL_FAULT"})
    assert again.returncode == 0, again.stderr
    a, b = load_file(str(out / "model.safetensors")), load_file(str(full_warm_start[0] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((out / "agentrl.json").read_text())
    assert summary["sft"]["resumed_at_steps"] == [1]
    assert summary["allocator"] == ("mimalloc" if sys.platform.startswith("linux") else "glibc")
