"""The learner's attention through agentrl's CPU kernel (train/attention.py, sampling/cpu_attention.c;
`learner.attention`): its forward and backward against SDPA's autograd on the masks the learner
makes (causal, packed rows' block-diagonal, right pads, a fork's suffixes over an expanded prefix),
the routing of what it does not take to SDPA, and a LocalLearner's update with it against the
same update with SDPA (a real LoRA on a tiny random Llama of head size 64). The real kernel, built
with the machine's C compiler; skipped where the CPU lacks AVX-512 (bf16: AVX512-BF16)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from agentrl.config import load_config
from agentrl.errors import UserError
from agentrl.sampling import cpu_attention
from agentrl.train import attention
from agentrl.train.learner import LocalLearner
from test_packing import learner_cfg as _cfg
from test_packing import trajectory  # a multi-turn trajectory: prompt, reply, observation, reply


def needs_kernel(dtype):
    why = cpu_attention.prefill_unavailable(dtype, 64) if cpu_attention._compiler() else "no C compiler"
    return pytest.mark.skipif(why is not None, reason=f"no CPU attention kernel here: {why}")


def _masks(b, m, L, kind, gen):
    """[b, 1, m, L] boolean: the learner's masks (queries are the last m of L positions)."""
    causal = attention.causal_mask(b, m, L).clone()
    if kind == "packed":  # three sequences in a row, each attending to itself
        seg = torch.zeros(L, dtype=torch.long)
        seg[L // 3:] = 1
        seg[2 * L // 3:] = 2
        return causal & (seg[L - m:, None] == seg[None, :])
    if kind == "padded":  # right pads: keys past each row's length hidden, the pads' own rows too
        lens = torch.randint(L // 2, L + 1, (b,), generator=gen)
        return causal & (torch.arange(L)[None, None, None, :] < lens[:, None, None, None])
    return causal


def _grads(q, k, v, mask, dout, fn):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _sdpa(q, k, v, mask, upcast=False):
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def _kernel(q, k, v, mask):
    return attention.KernelAttention.apply(q, k, v, mask, q.shape[-1] ** -0.5)


def _case(b, hkv, g, d, m, L, dtype, kind, expand_kv=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, hkv * g, d, generator=gen).to(dtype).transpose(1, 2)  # the model's layout
    kb = 1 if expand_kv else b
    k = torch.randn(kb, hkv, L, d, generator=gen).to(dtype).expand(b, -1, -1, -1)  # a fork: one prefix's keys
    v = torch.randn(kb, hkv, L, d, generator=gen).to(dtype).expand(b, -1, -1, -1)
    mask = _masks(b, m, L, kind, gen)
    dout = torch.randn(b, m, hkv * g, d, generator=gen).to(dtype)
    return q, k, v, mask, dout


CASES = [(2, 3, 3, 64, 100, 100, "causal", False), (2, 3, 3, 64, 150, 150, "packed", False),
         (3, 2, 2, 64, 70, 70, "padded", False), (3, 1, 4, 64, 20, 90, "causal", True),
         (1, 2, 1, 128, 40, 40, "causal", False)]


@needs_kernel(torch.float32)
@pytest.mark.parametrize("b,hkv,g,d,m,L,kind,expand_kv", CASES)
def test_forward_and_backward_are_sdpas_in_fp32(b, hkv, g, d, m, L, kind, expand_kv):
    q, k, v, mask, dout = _case(b, hkv, g, d, m, L, torch.float32, kind, expand_kv)
    ref, want = _grads(q, k, v, mask, dout, _sdpa)[0], _grads(q, k, v, mask, dout, _sdpa)[1:]
    out, *got = _grads(q, k, v, mask, dout, _kernel)
    sees = mask[:, 0].any(-1)
    assert (out[sees] - ref[sees]).abs().max() <= 2e-6
    assert torch.equal(out[~sees], torch.zeros_like(out[~sees]))  # a query that sees nothing: zeros
    for name, a, r in zip("qkv", got, want):
        assert a.shape == r.shape, name
        assert (a - r).abs().max() <= 1e-5 * max(1.0, r.abs().max().item()), name


@needs_kernel(torch.bfloat16)
@pytest.mark.parametrize("b,hkv,g,d,m,L,kind,expand_kv", CASES[:3])
def test_bf16_is_as_close_to_fp32_as_sdpas_own(b, hkv, g, d, m, L, kind, expand_kv):
    q, k, v, mask, dout = _case(b, hkv, g, d, m, L, torch.bfloat16, kind, expand_kv)
    exact = _grads(q, k, v, mask, dout, lambda *a: _sdpa(*a, upcast=True))
    sdpa = _grads(q, k, v, mask, dout, _sdpa)
    ours = _grads(q, k, v, mask, dout, _kernel)
    sees = mask[:, 0].any(-1)
    for i, (x, s, e) in enumerate(zip(ours, sdpa, exact)):
        if i == 0:
            x, s, e = x[sees], s[sees], e[sees]
        assert (x.float() - e).abs().mean() <= 1.25 * (s.float() - e).abs().mean() + 1e-6, i


@needs_kernel(torch.float32)
def test_one_thread_and_two_agree_exactly():
    q, k, v, mask, dout = _case(2, 3, 3, 64, 120, 120, torch.float32, "packed")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(q, k, v, mask, dout, _kernel)
        torch.set_num_threads(2)
        two = _grads(q, k, v, mask, dout, _kernel)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))  # each sum is one task's, added in a fixed order


@needs_kernel(torch.float32)
def test_learner_attention_takes_what_the_kernel_takes_and_hands_the_rest_to_sdpa(monkeypatch):
    calls = []  # a no-grad call: the kernel's forward without the log-sum-exp (its prefill)
    real = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *a: calls.append(a[0].shape) or real(*a))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2  # what SDPA's path reads of a layer
    q, k, v, mask, _ = _case(2, 2, 2, 64, 30, 30, torch.float32, "causal")
    out, _ = attention.learner_attention(module, q, k, v, None)  # no mask: the causal one, made here
    assert calls == [q.shape] and out.shape == (2, 30, 4, 64)
    assert torch.allclose(out, _sdpa(q, k, v, mask), atol=2e-6)
    attention.learner_attention(module, q, k, v, mask, dropout=0.1)  # dropout: SDPA's
    attention.learner_attention(module, q, k, v, torch.zeros(mask.shape))  # an additive float mask: SDPA's
    q16, k16, v16 = q[..., :16], k[..., :16], v[..., :16]
    attention.learner_attention(module, q16, k16, v16, mask)  # head size 16: SDPA's
    assert len(calls) == 1


def _batch():
    """Ten trajectories; four of them a group's, beginning with the same 90-token prompt (a fork)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (90,), generator=g).tolist()
    seqs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in [37, 5, 120, 64, 9, 88]]
    seqs += [prompt + torch.randint(0, 1000, (n,), generator=g).tolist() for n in [40, 25, 61, 33]]
    return [(trajectory(ids, i), adv) for i, (ids, adv) in enumerate(zip(seqs, [1.0, -0.5, 2.0, -1.0, 0.3] * 2))]


@needs_kernel(torch.float32)
@pytest.mark.parametrize("layout", [dict(tokens_per_microbatch=160), dict(packing=False, micro_batch=4)])
def test_the_learners_update_with_the_kernel_is_sdpas(head64_model, layout, monkeypatch):
    """GRPO's update on packed rows or padded ones, forks of the group's shared prompt included:
    the same log-probs, loss and gradient as SDPA's, every forward and backward through the kernel."""
    calls = {"forward": 0, "backward": 0}
    for fn in calls:
        real = getattr(cpu_attention, fn)
        monkeypatch.setattr(cpu_attention, fn, lambda *a, _f=fn, _r=real: calls.__setitem__(_f, calls[_f] + 1) or _r(*a))
    batch = _batch()
    runs = {}
    for name in ("sdpa", "kernel"):
        learner = LocalLearner(copy.deepcopy(head64_model), _cfg(attention=name, share_prefixes=True, **layout))
        assert learner.attention_kernel is (name == "kernel")
        logp = learner._logprobs([(t, a) for t, a in batch])
        stats = learner.update(batch)
        runs[name] = (logp, stats, torch.cat([p.grad.flatten() for p in learner.params]))
    (lp_s, st_s, g_s), (lp_k, st_k, g_k) = runs["sdpa"], runs["kernel"]
    layers = head64_model.config.num_hidden_layers
    assert calls["forward"] >= 2 * layers and calls["backward"] >= layers  # none in the SDPA run: it ran first
    for a, b in zip(lp_s, lp_k):
        assert torch.allclose(a, b, atol=1e-5)
    assert st_k.loss == pytest.approx(st_s.loss, rel=1e-5, abs=1e-6)
    assert g_s.abs().max() > 0 and torch.allclose(g_k, g_s, rtol=1e-4, atol=1e-6)


@needs_kernel(torch.float32)
def test_the_setting_decides_once_and_refuses_in_one_line(head64_model, tiny_model):
    from agentrl.sampling.compat import text_config

    sdpa = LocalLearner(copy.deepcopy(head64_model), _cfg(attention="sdpa"))
    assert text_config(sdpa.model.config)._attn_implementation != attention.LEARNER_ATTENTION
    assert LocalLearner(copy.deepcopy(tiny_model), _cfg()).attention_kernel is False  # auto, head size 16: SDPA
    with pytest.raises(UserError, match=r"^learner.attention=kernel: the prefill kernel runs head sizes 64 and 128, "
                                        r"not 16; choose auto or sdpa$"):
        LocalLearner(copy.deepcopy(tiny_model), _cfg(attention="kernel"))
    assert attention.kernel_for("auto", "cuda", torch.bfloat16, head64_model.config) is False
    with pytest.raises(UserError, match="^learner.attention must be one of auto, kernel, sdpa, got 'x'$"):
        load_config(None, {"learner.attention": "x"})
    assert load_config(None, {}).learner.attention == "auto"


@needs_kernel(torch.bfloat16)
def test_under_autocast_the_kernel_runs_in_autocasts_dtype(head64_model, monkeypatch):
    """An fp32 model under `learner.autocast: bf16`: RoPE hands attention fp32 queries and keys
    beside bf16 values; the kernel takes all three in autocast's dtype, as SDPA would."""
    dtypes = []  # a no-grad forward: the kernel's prefill
    real = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *a: dtypes.append(a[0].dtype) or real(*a))
    learner = LocalLearner(copy.deepcopy(head64_model), _cfg(autocast="bf16"))
    ids = torch.randint(0, 1000, (1, 50))
    with torch.no_grad(), learner.autocast():
        learner.model(input_ids=ids)
    assert dtypes and set(dtypes) == {torch.bfloat16}
