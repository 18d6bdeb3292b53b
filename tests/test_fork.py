"""The learner's shared prefixes (`packing.fork`, `learner.share_prefixes`): sequences that begin
alike forward their prefix once and each suffix against its keys and values; the log-probs, the
losses and the gradient are those of each sequence's own forward (a real LoRA on the tiny random
Llama, fp32)."""

import copy

import pytest
import torch

from agentrl.config import LearnerConfig
from agentrl.env.data import Game
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.bc import masked_nll_sum
from agentrl.train.learner import LocalLearner, lora_config
from agentrl.train.packing import Forked, Packed, fork, pack, sequence_logprobs

GAME = Game("task/trial", "train", "pick_and_place_simple", None)


def learner_cfg(**kw):
    return LearnerConfig(lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lr=1e-3, **kw)


def peft(tiny_model):
    from peft import get_peft_model

    from agentrl.models import quiet_peft

    torch.manual_seed(1)
    with quiet_peft():
        model = get_peft_model(copy.deepcopy(tiny_model), lora_config(learner_cfg()))
    for name, p in model.named_parameters():  # LoRA's B starts at 0: give it weight, so the prefix's gradient is not 0
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def family(prefix: int, suffixes: list[int], others: list[int] = (), seed: int = 0, vocab: int = 1000):
    """Sequences beginning with one `prefix`-token opening, then their own tokens (lengths `suffixes`),
    and unrelated ones (lengths `others`); action masks 1 at every third token past the opening."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    seqs = [head + torch.randint(0, vocab, (n,), generator=g).tolist() for n in suffixes]
    seqs += [torch.randint(0, vocab, (n,), generator=g).tolist() for n in others]
    masks = [[int(t > prefix + 2 and t % 3 == 0) for t in range(len(s))] for s in seqs]
    return seqs, masks


def logprobs_and_grad(model, batch, masks):
    model.zero_grad()
    logp = sequence_logprobs(model, batch, chunk=16, masks=masks)
    weight = torch.linspace(0.5, 1.5, logp.numel()).reshape(logp.shape)  # a different weight per token
    (logp * weight).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("packed", [True, False])
def test_a_fork_gives_each_sequence_its_own_log_probs_and_the_same_gradient(tiny_model, packed):
    """Three sequences sharing an 80-token opening (one fork) and one unrelated (packed as before):
    the same per-token log-probs and gradient as the whole packed batch, to fp32 round-off."""
    model = peft(tiny_model)
    seqs, masks = family(80, [30, 55, 12], others=[40])
    rows = [[0, 3], [1], [2]]
    order = [i for row in rows for i in row]
    m = [masks[i] for i in order]
    forked = fork(seqs, rows, m, "cpu", packed=packed, min_prefix=16)
    assert isinstance(forked, Forked) and len(forked.forks) == 1
    assert sorted(order[k] for k in forked.forks[0].members) == [0, 1, 2]
    assert forked.forks[0].shared == 80 and [order[k] for k in forked.rest_members] == [3]
    want, g_want = logprobs_and_grad(model, pack(seqs, rows, "cpu", packed), m)
    got, g_got = logprobs_and_grad(model, forked, m)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert not got[torch.tensor([[x == 0 for x in mm] + [True] * (got.shape[1] - len(mm)) for mm in m])].any()
    assert g_want.abs().max() > 0 and (g_got - g_want).abs().max() <= 1e-4 * g_want.abs().max()


def test_a_prefix_stops_before_the_first_action_token(tiny_model):
    """Rows that agree through an action (G rows that took the same first action): the fork's prefix
    ends before it, so that action's log-prob is each row's own, as unforked."""
    model = peft(tiny_model)
    seqs, masks = family(80, [30, 40])
    for m in masks:
        m[50:53] = [1, 1, 1]  # an action inside the common opening
    forked = fork(seqs, [[0], [1]], masks, "cpu", packed=False, min_prefix=16)
    assert isinstance(forked, Forked) and forked.forks[0].shared == 49
    got, g_got = logprobs_and_grad(model, forked, masks)
    want, g_want = logprobs_and_grad(model, pack(seqs, [[0], [1]], "cpu", False), masks)
    assert torch.allclose(got, want, atol=1e-5) and got[:, 50:53].abs().min() > 0
    assert (g_got - g_want).abs().max() <= 1e-4 * g_want.abs().max()


def test_a_fork_is_taken_only_where_it_computes_fewer_tokens():
    seqs, masks = family(20, [5, 280])
    assert isinstance(fork(seqs, [[0], [1]], masks, "cpu", packed=True, min_prefix=16), Packed)  # 20 + 2 x 280 > 25 + 300
    assert isinstance(fork(seqs, [[0], [1]], masks, "cpu", packed=False, min_prefix=16), Forked)  # padded rows: 2 x 300
    seqs, masks = family(10, [40, 40])
    assert isinstance(fork(seqs, [[0], [1]], masks, "cpu", min_prefix=16), Packed)  # shorter than min_prefix


def test_admissible_actions_allowed_ids_follow_the_suffix_layout(tiny_model):
    """Renormalised over the ids each action token was drawn among: the same numbers forked."""
    model = peft(tiny_model)
    seqs, masks = family(64, [20, 26])
    constraints = []
    for s, m in zip(seqs, masks):
        constraints.append((m, [[s[t], (s[t] + 7) % 1000, 3] for t in range(len(s)) if m[t]]))
    forked = fork(seqs, [[0], [1]], masks, "cpu", packed=True, constraints=constraints, min_prefix=16)
    assert isinstance(forked, Forked) and forked.forks[0].allowed is not None
    with torch.no_grad():
        got = sequence_logprobs(model, forked, masks=masks)
        want = sequence_logprobs(model, pack(seqs, [[0, 1]], "cpu", True, constraints=constraints), masks=masks)
        free = sequence_logprobs(model, pack(seqs, [[0, 1]], "cpu", True), masks=masks)
    assert torch.allclose(got, want, atol=1e-5)
    assert (got - free)[free < 0].min() > 1.0  # renormalised over 3 ids, not the ~49k of the vocabulary


def test_the_warm_start_nll_forked_is_the_packed_nll(tiny_model):
    model = peft(tiny_model)
    seqs, masks = family(70, [33, 21, 48], others=[25])
    rows = [[0], [1, 3], [2]]
    m = [masks[i] for row in rows for i in row]
    with torch.no_grad():
        a, n_a = masked_nll_sum(model, pack(seqs, rows, "cpu", True), m)
        b, n_b = masked_nll_sum(model, fork(seqs, rows, m, "cpu", packed=True, min_prefix=16), m)
    assert n_a == n_b > 0 and float(b) == pytest.approx(float(a), rel=1e-5)


def trajectory(prompt: list[int], rest: list[int], index: int) -> Trajectory:
    """A group's trajectory: the shared first prompt, a reply, an observation, a reply."""
    t = Trajectory(game=GAME, index=index)
    a, b = len(rest) // 3, 2 * len(rest) // 3
    t.append(prompt, generated=False)
    t.append(rest[:a], generated=True, logprobs=[-1.0] * a)
    t.append(rest[a:b], generated=False)
    t.append(rest[b:], generated=True, logprobs=[-2.0] * (len(rest) - b))
    return t


def test_the_learner_update_with_shared_prefixes_is_the_update_without(tiny_model):
    """GRPO's update over two groups of four trajectories (each group's rows share their 90-token
    first prompt), micro-batches of 4 rows: the same pre-pass log-probs, loss and gradient with
    `learner.share_prefixes` on as off, and the forks really ran."""
    g = torch.Generator().manual_seed(3)
    batch = []
    for group in range(2):
        prompt = torch.randint(0, 1000, (90,), generator=g).tolist()
        for i in range(4):
            rest = torch.randint(0, 1000, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
            batch.append((trajectory(prompt, rest, i), [1.0, -1.0, 0.5, -0.5][i]))
    learners = []
    for share in (False, True):
        learner = LocalLearner(copy.deepcopy(tiny_model), learner_cfg(micro_batch=4, share_prefixes=share, kl_coef=0.0))
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                torch.manual_seed(1)
                torch.nn.init.normal_(p, std=0.05)
        learners.append(learner)
    plain, shared = learners
    assert shared.forks and not plain.forks
    checkpointed = LocalLearner(copy.deepcopy(tiny_model), learner_cfg(gradient_checkpointing=True))
    assert not checkpointed.forks  # transformers drops the cache under activation checkpointing
    rows = shared.micro_batches([len(t.token_ids) for t, _ in batch])[0]
    inputs = shared.inputs([t.token_ids for t, _ in batch], rows, masks=[batch[i][0].action_mask for r in rows for i in r])
    assert isinstance(inputs, Forked) and inputs.forks[0].shared == 89
    for a, b in zip(plain._logprobs(batch), shared._logprobs(batch)):
        assert torch.allclose(a, b, atol=1e-5)
    s_plain, s_shared = plain.update(batch), shared.update(batch)
    assert s_shared.grad_l2_norm > 0 and s_shared.loss == pytest.approx(s_plain.loss, rel=1e-5, abs=1e-6)
    assert torch.allclose(torch.cat([p.grad.flatten() for p in shared.params]),
                          torch.cat([p.grad.flatten() for p in plain.params]), rtol=1e-4, atol=1e-6)
