"""Packed, token-budgeted micro-batches and autocast: the same log-probs, losses and gradients as
one unpacked batch (a real LoRA on the tiny random Llama), and the settings that drive them."""

import copy
import random

import pytest
import torch

from agentrl.config import LearnerConfig, load_config
from agentrl.env.data import Game
from agentrl.errors import UserError
from agentrl.rollout.trajectory import Trajectory
from agentrl.train import memory
from agentrl.train.learner import LocalLearner, lora_config
from agentrl.train.loss import token_logprobs
from agentrl.train.packing import (autocast_dtype, first_fit_decreasing, pack, sequence_logprobs, supports_packing,
                                   token_micro_batches)

GAME = Game("task/trial", "train", "pick_and_place_simple", None)
LENGTHS = [37, 5, 120, 64, 9, 88, 17, 3, 51, 70]


def test_first_fit_decreasing_places_every_sequence_once_within_the_capacity():
    lengths = [random.Random(s).randint(1, 100) for s in range(60)]
    rows = first_fit_decreasing(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(60))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert first_fit_decreasing([3, 7, 5, 1], 8) == [[1, 3], [2, 0]]  # 7+1, 5+3: longest first, first row with room
    assert first_fit_decreasing([10, 2], 8) == [[0], [1]]  # longer than a row: a row of its own
    assert first_fit_decreasing([], 8) == []


@pytest.mark.parametrize("packed", [True, False])
def test_token_micro_batches_hold_at_most_the_budget(packed):
    batches = token_micro_batches(LENGTHS, 160, pack=packed)
    assert sorted(i for b in batches for row in b for i in row) == list(range(len(LENGTHS)))
    for b in batches:
        fill = [sum(LENGTHS[i] for i in row) for row in b]
        assert len(b) == 1 or len(b) * max(fill) <= 160
        assert packed or all(len(row) == 1 for row in b)
    assert len(token_micro_batches(LENGTHS, 160)) < len(token_micro_batches(LENGTHS, 160, pack=False))


def sequences(n_seq=len(LENGTHS), vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS[:n_seq]]


def alone(model, ids):
    return token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("packed", [True, False])
def test_packed_log_probs_are_each_sequences_own(tiny_model, attention, packed):
    """Position ids restarting per sequence: transformers masks each sequence to itself (sdpa,
    eager), so each sequence's log-probs are those of its own forward, to 1e-5 in fp32."""
    model = copy.deepcopy(tiny_model)
    model.config._attn_implementation = attention
    assert supports_packing(model)
    assert not supports_packing(type("RemoteCode", (), {"config": model.config})())  # model code of its own: padded
    seqs = sequences()
    with torch.no_grad():
        for rows in token_micro_batches([len(s) for s in seqs], 200, pack=packed):
            batch = pack(seqs, rows, "cpu", packed)
            got = sequence_logprobs(model, batch, chunk=16)
            for k, i in enumerate(i for row in rows for i in row):
                n = len(seqs[i])
                assert torch.allclose(got[k, :n], alone(model, seqs[i]), atol=1e-5)
                assert not got[k, n:].any()  # right-padded with exact zeros


def test_log_probs_of_the_action_tokens_alone_are_the_same_numbers_and_gradient(tiny_model):
    """`masks`: the vocabulary projection runs at the action tokens only; there the log-probs and
    the gradient of a loss on them are those of the projection over every position, 0 elsewhere."""
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_model), lora_config(learner_cfg()))
    seqs = sequences(4)
    masks = [[int(k % 3 == 1 or k > n - 4) for k in range(n)] for n in map(len, seqs)]
    batch = pack(seqs, [[0, 1], [2, 3]], "cpu", True)
    results = []
    for m in (None, masks):
        model.zero_grad()
        logp = sequence_logprobs(model, batch, chunk=16, masks=m)
        weight = torch.zeros_like(logp)
        for k, mask in enumerate(masks):
            weight[k, : len(mask)] = torch.tensor(mask, dtype=weight.dtype)
        (logp * weight).sum().backward()
        results.append((logp.detach(), weight, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (full, weight, g_full), (picked, _, g_picked) = results
    assert torch.allclose(picked, full * weight, atol=1e-6)  # the action tokens' numbers; 0 elsewhere
    assert not picked[weight == 0].any() and picked[weight == 1].abs().min() > 0
    assert g_full.abs().max() > 0 and (g_picked - g_full).abs().max() <= 1e-5 * g_full.abs().max(), (g_picked - g_full).abs().max()


def trajectory(ids, index):
    """A multi-turn trajectory: prompt, reply, observation, reply (action masks 0/1/0/1)."""
    t = Trajectory(game=GAME, index=index)
    a, b, c = len(ids) // 3, len(ids) // 2, 2 * len(ids) // 3
    t.append(ids[:a], generated=False)
    t.append(ids[a:b], generated=True, logprobs=[-1.0] * (b - a))
    t.append(ids[b:c], generated=False)
    t.append(ids[c:], generated=True, logprobs=[-2.0] * (len(ids) - c))
    return t


def learner_cfg(**kw):
    return LearnerConfig(lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lr=1e-3, **kw)


def grads(learner):
    return torch.cat([p.grad.flatten() for p in learner.params])


@pytest.mark.parametrize("agg", ["seq-sum", "token-mean", "seq-mean-token-mean"])
def test_the_update_gradient_is_the_unpacked_whole_batch_gradient(tiny_model, agg):
    """GRPO's update on packed micro-batches of 96 tokens gives the gradient (and loss) of one
    padded forward over the whole batch, and the same log-probs of the policy before it."""
    batch = [(trajectory(ids, i), adv) for i, (ids, adv) in enumerate(zip(sequences(), [1.0, -0.5, 2.0, -1.0, 0.3] * 2))]
    whole = LocalLearner(copy.deepcopy(tiny_model), learner_cfg(loss_agg=agg, tokens_per_microbatch=None,
                                                                micro_batch=len(batch), packing=False))
    packed = LocalLearner(copy.deepcopy(tiny_model), learner_cfg(loss_agg=agg, tokens_per_microbatch=96))
    assert len(packed.micro_batches(LENGTHS)) > 2 and packed.packing
    work = [(t, a) for t, a in batch]
    for before, after in zip(whole._logprobs(work), packed._logprobs(work)):
        assert torch.allclose(before, after, atol=1e-5)
    a, b = whole.update(batch), packed.update(batch)
    assert b.grad_l2_norm > 0 and b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
    assert torch.allclose(grads(packed), grads(whole), rtol=1e-4, atol=1e-6)


def test_the_warm_start_step_gradient_is_the_unpacked_whole_batch_gradient(tiny_model):
    """sft's loss (token-mean NLL over the step's replies) through packed micro-batches: the
    gradient of one padded forward over the step's examples."""
    from agentrl.train.sft import Example, example_micro_batches, nll_loss

    examples = [Example("g", "t", ids, trajectory(ids, 0).action_mask) for ids in sequences()]
    n_tokens = sum(e.reply_tokens for e in examples)
    results = []
    for cfg in (learner_cfg(tokens_per_microbatch=None, micro_batch=len(examples), packing=False),
                learner_cfg(tokens_per_microbatch=128)):
        learner = LocalLearner(copy.deepcopy(tiny_model), cfg)
        parts = example_micro_batches(learner, examples)
        step = learner.step(parts, nll_loss(learner, examples, n_tokens), None)
        results.append((len(parts), step.loss, sum(step.values), grads(learner)))
    (n_whole, loss_whole, nll_whole, g_whole), (n_packed, loss_packed, nll_packed, g_packed) = results
    assert n_whole == 1 and n_packed > 2
    assert loss_packed == pytest.approx(loss_whole, rel=1e-5) and nll_packed == pytest.approx(nll_whole, rel=1e-5)
    assert torch.allclose(g_packed, g_whole, rtol=1e-4, atol=1e-6)


def test_autocast_is_bf16_on_cuda_only_unless_asked_and_keeps_the_lora_state_fp32(tiny_model):
    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("off", "cpu") is None
    assert autocast_dtype("bf16", "cpu") == torch.bfloat16
    seqs = [trajectory(ids, i) for i, ids in enumerate(sequences(4))]
    batch = [(t, a) for t, a in zip(seqs, [1.0, -1.0, 0.5, -0.5])]
    fp32 = LocalLearner(copy.deepcopy(tiny_model), learner_cfg())
    bf16 = LocalLearner(copy.deepcopy(tiny_model), learner_cfg(autocast="bf16"))
    a, b = fp32.update(batch), bf16.update(batch)
    assert b.stepped and b.loss == pytest.approx(a.loss, rel=0.05)  # bf16 matmuls: close, not equal
    assert all(p.dtype == torch.float32 for p in bf16.params)
    assert all(s.dtype == torch.float32 for st in bf16.optimizer.state.values() for s in st.values() if s.dim())
    # a bf16 base (the CUDA default): the LoRA and its AdamW moments are fp32 all the same (PEFT's adapter dtype)
    half = LocalLearner(copy.deepcopy(tiny_model).to(torch.bfloat16), learner_cfg(autocast="bf16"))
    assert half.update(batch).stepped and all(p.dtype == torch.float32 for p in half.params)


def test_the_token_budget_is_sized_from_free_memory_or_taken_as_given(tiny_model, monkeypatch):
    """Free memory is held still here: read twice on a busy machine it moves between the two
    readings (CI once saw the budget 3 tokens above a later reading's)."""
    model = copy.deepcopy(tiny_model)
    assert memory.tokens_per_microbatch(512, model, "cpu", False) == 512
    assert memory.tokens_per_microbatch(None, model, "cpu", False) is None
    real = memory.tokens_per_microbatch("auto", model, "cpu", False)  # this machine's own reading
    assert 64 <= real <= memory.MAX_TOKENS_PER_MICROBATCH
    per_token = memory.activation_bytes_per_token(model.config, 4, False) + memory.loss_bytes_per_token(model.config)
    for free, expected in ((2 ** 30, 2 ** 30 // per_token), (10 * per_token, 64), (10 ** 15, memory.MAX_TOKENS_PER_MICROBATCH)):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device, free=free: memory.RESERVE_BYTES + free)
        auto = memory.tokens_per_microbatch("auto", model, "cpu", False)
        assert auto == expected
        assert memory.tokens_per_microbatch("auto", model, "cpu", True) >= auto  # checkpointing keeps less per token


@pytest.mark.parametrize("key, value, needle", [
    ("learner.tokens_per_microbatch", 10, "learner.tokens_per_microbatch must be auto, a number >= 64 or null"),
    ("learner.tokens_per_microbatch", "lots", "learner.tokens_per_microbatch must be auto"),
    ("learner.autocast", "fp16", "learner.autocast must be one of auto, bf16, off"),
    ("learner.packing", "yes", "learner.packing must be bool"),
])
def test_bad_learner_speed_settings_are_refused_in_one_line(key, value, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, {key: value})
