"""agentrl's decode-step attention kernel on the CPU (sampling/cpu_attention.py, decode_attention.c;
`sampling.decode_attention`): the kernel against SDPA on the shapes and strides the slot store
gives it, the sampler's replies and log-probs with it against SDPA's, the setting's one-line
refusals, and the build cache. The real kernel, built with the machine's C compiler (CI has gcc);
no fakes but a missing compiler, made by pointing $CC at nothing."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from agentrl.errors import UserError
from agentrl.sampling import cpu_attention
from agentrl.sampling.attention import decode_kernel_for
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.sampling.kv import slot_attention, use_slot_attention
from scripted import rows

# the kernel is built with the machine's C compiler (CI's has gcc); without one `auto` runs SDPA
needs_cc = pytest.mark.skipif(cpu_attention._compiler() is None, reason="no C compiler to build the kernel")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache root of its own and no loaded kernel, restored after (so other tests reload theirs)."""
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    cpu_attention.load.cache_clear()
    yield tmp_path
    cpu_attention.load.cache_clear()


def _case(b, h, g, d, L, dtype, capacity_extra=7, seed=0):
    """q [b, h, g, d]; k/v: views of a store [slots, h, capacity, d] (rows' strides not packed);
    a mask with holes (not only a prefix), one row with no key at all."""
    gen = torch.Generator().manual_seed(seed)
    store_k = torch.randn(b + 2, h, L + capacity_extra, d, generator=gen).to(dtype)
    store_v = torch.randn(b + 2, h, L + capacity_extra, d, generator=gen).to(dtype)
    k, v = store_k[1:b + 1, :, :L], store_v[1:b + 1, :, :L]
    q = torch.randn(b, h, g, d, generator=gen).to(dtype)
    mask = torch.rand(b, 1, 1, L, generator=gen) < 0.8
    mask[0] = False  # nothing to attend to: zeros, as SDPA's CPU kernels give
    if b > 1:
        mask[1, ..., : L // 2] = False  # a left-padded row
    return q, k, v, mask


@needs_cc
@pytest.mark.parametrize("g,d", [(3, 64), (1, 64), (4, 64), (7, 64), (2, 16), (7, 128), (4, 80)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_the_kernel_is_sdpa(g, d, dtype, tol):
    q, k, v, mask = _case(5, 3, g, d, 300, dtype)
    scale = d ** -0.5
    out = cpu_attention.decode(q, k, v, mask, scale)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert (out.float() - ref).abs().max().item() <= tol


@needs_cc
def test_one_thread_and_two_agree_exactly():
    q, k, v, mask = _case(6, 3, 3, 64, 500, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.decode(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (row, head) is one thread's: no order of sums depends on the split


@needs_cc
def test_what_the_kernel_does_not_take_is_left_to_sdpa():
    q, k, v, mask = _case(2, 3, 3, 64, 40, torch.float32)
    assert cpu_attention.decode(q.half(), k.half(), v.half(), mask, 0.125) is None  # fp16
    assert cpu_attention.decode(q, k.double(), v, mask, 0.125) is None  # mixed dtypes
    big = torch.zeros(2, 1, 17, 64)
    assert cpu_attention.decode(big, k[:, :1], v[:, :1], mask, 0.125) is None  # G > 16
    assert cpu_attention.decode(q, k, v, mask.float(), 0.125) is None  # not a boolean mask


@needs_cc
def test_slot_attention_runs_the_kernel_only_inside_a_kernel_call(monkeypatch, tiny_model):
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a: calls.append(a[0].shape) or real(*a))
    q = torch.randn(2, 4, 1, 16)  # [b, Hq, 1, D]: a decode step of 4 query heads over 2 KV heads
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    plain, _ = slot_attention(None, q, k, v, mask, scaling=0.25)
    assert calls == []
    with use_slot_attention(tiny_model, decode_kernel=True):
        fast, _ = slot_attention(None, q, k, v, mask, scaling=0.25)
        slot_attention(None, torch.randn(2, 4, 3, 16), k, v, torch.ones(2, 1, 3, 9, dtype=torch.bool), scaling=0.25)
    assert calls == [(2, 2, 2, 16)]  # the decode step, folded; the prefill ran SDPA
    assert fast.shape == plain.shape == (2, 1, 4, 16) and torch.allclose(fast, plain, atol=1e-6)
    slot_attention(None, q, k, v, mask, scaling=0.25)
    assert len(calls) == 1  # the setting ends with the block


def _teacher_forced(model, prompt, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)]


@needs_cc
def test_the_samplers_logprobs_with_the_kernel_are_a_teacher_forced_forwards(monkeypatch, tiny_model, tokenizer):
    """fp32: each reply's log-probs, greedy and sampled at temperature 1, equal a teacher-forced
    forward of the same tokens (SDPA over the whole sequence) to 1e-5, over a first turn and a
    reused one (decode steps then read cached and new keys), with every decode step through the
    kernel. Whatever tokens this CPU's floats pick, the check is on those tokens."""
    calls = []
    real = cpu_attention.decode
    monkeypatch.setattr(cpu_attention, "decode", lambda *a: calls.append(1) or real(*a))
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in
               ["Thought: short", "a somewhat longer prompt so that left padding matters here", "x"]]
    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=10), SamplingParams(temperature=1.0, max_new_tokens=8)
    sampler = HFSampler(tiny_model, tokenizer, decode_attention="kernel")
    assert sampler.decode_kernel is True and HFSampler(tiny_model, tokenizer, decode_attention="sdpa").decode_kernel is False
    first = sampler.generate(rows(prompts, keys=["a", "b", "c"]), greedy)
    turn = [p + c.token_ids + prompts[0] for p, c in zip(prompts, first)]
    second = sampler.generate(rows(turn, seeds=[1, 2, 3], keys=["a", "b", "c"]), sampled)
    assert calls and len(calls) % tiny_model.config.num_hidden_layers == 0  # every layer of every decode step
    for prompt, c in zip(prompts + turn, first + second):
        assert c.logprobs == pytest.approx(_teacher_forced(tiny_model, prompt, c.token_ids), abs=1e-5)


@needs_cc
def test_the_setting_decides_once_and_refuses_in_one_line(fresh_build, monkeypatch, caplog):
    assert decode_kernel_for("auto", "auto", "cpu") is True
    assert decode_kernel_for("sdpa", "auto", "cpu") is False
    assert decode_kernel_for("auto", "math", "cpu") is False  # a pinned SDPA kernel is what runs
    assert decode_kernel_for("kernel", "math", "cpu") is True  # asked for both: the pin serves the prefill
    assert decode_kernel_for("auto", "auto", "cuda") is False
    with pytest.raises(UserError, match=r"^sampling.decode_attention=kernel: agentrl's decode kernel runs on a CPU, "
                                        r"this sampler on cuda; choose auto or sdpa$"):
        decode_kernel_for("kernel", "auto", "cuda")
    with pytest.raises(UserError, match=r"^sampling.decode_attention must be one of auto, kernel, sdpa, got 'fast'$"):
        decode_kernel_for("fast", "auto", "cpu")
    cpu_attention.load.cache_clear()
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with pytest.raises(UserError) as e:
        decode_kernel_for("kernel", "auto", "cpu")
    assert "\n" not in str(e.value) and "no-such-compiler does not run" in str(e.value)
    with caplog.at_level("WARNING"):
        assert decode_kernel_for("auto", "auto", "cpu") is False  # auto: SDPA, said once in the log
    assert "decode steps run SDPA's attention" in caplog.text


def test_an_unknown_setting_is_refused_by_the_config():
    from agentrl.config import load_config

    with pytest.raises(UserError, match="^sampling.decode_attention must be one of auto, kernel, sdpa, got 'x'$"):
        load_config(None, {"sampling.decode_attention": "x"})
    assert load_config(None, {}).sampling.decode_attention == "auto"


@needs_cc
def test_the_build_is_kept_and_reused_and_a_failed_build_leaves_nothing(fresh_build, monkeypatch):
    cpu_attention.load()
    built = list((fresh_build / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("decode-attention-") and built[0].suffix == ".so"
    cpu_attention.load.cache_clear()
    compiles = []
    real_run = subprocess.run

    def run(cmd, **kw):
        if "-c" in cmd or "-shared" in cmd:
            compiles.append(cmd)
        return real_run(cmd, **kw)

    monkeypatch.setattr(cpu_attention.subprocess, "run", run)
    cpu_attention.load()
    assert compiles == []  # the second process loads the first one's build
    # a source that does not compile: one line, no half-written library left in the cache
    cpu_attention.load.cache_clear()
    bad = fresh_build / "bad.c"
    bad.write_text("int broken(")
    monkeypatch.setattr(cpu_attention, "SOURCE", bad)
    why = cpu_attention.available()
    assert why is not None and "\n" not in why and "could not build bad.c" in why
    assert sorted(p.name for p in (fresh_build / "kernels").iterdir()) == [built[0].name]


def test_a_cache_it_cannot_write_is_one_line_and_auto_runs_sdpa(monkeypatch, tmp_path, fresh_build):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AGENTRL_CACHE", str(blocker / "cache"))  # under a file: no directory can be made
    why = cpu_attention.available()
    assert why is not None and "\n" not in why and why.startswith("cannot write the decode-attention kernel into")
    assert decode_kernel_for("auto", "auto", "cpu") is False
