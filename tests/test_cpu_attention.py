"""agentrl's attention kernel on the CPU (sampling/cpu_attention.py, cpu_attention.c): a decode
step's (`sampling.decode_attention`) and a prefill's (`sampling.prefill_attention`) against SDPA
on the shapes and strides the slot store gives them, the sampler's log-probs with them against a
teacher-forced forward, the settings' one-line refusals, and the build cache. The real kernel,
built with the machine's C compiler (CI has gcc); no fakes but a missing compiler, made by
pointing $CC at nothing. The prefill's tests skip where the CPU lacks AVX-512 (bf16's: also
AVX512-BF16), where `auto` runs SDPA."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from agentrl.errors import UserError
from agentrl.sampling import cpu_attention
from agentrl.sampling.attention import decode_kernel_for, prefill_kernel_for
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
    assert len(built) == 1 and built[0].name.startswith("cpu-attention-") and built[0].suffix == ".so"
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
    assert why is not None and "\n" not in why and why.startswith("cannot write the CPU attention kernel into")
    assert decode_kernel_for("auto", "auto", "cpu") is False


# ---------------------------------------------------------------- a prefill


def needs_prefill(dtype):
    """The prefill kernel runs this dtype on this CPU (AVX-512; bf16: AVX512-BF16)."""
    why = cpu_attention.prefill_unavailable(dtype, 64) if cpu_attention._compiler() else "no C compiler"
    return pytest.mark.skipif(why is not None, reason=f"no prefill kernel here: {why}")


def _prefill_case(b, h, g, d, m, L, dtype, seed=0):
    """q [b, h * g, m, d] in the model's layout (a transposed view of [b, m, heads, d]); k/v views of
    a store with room to grow; each row's m new tokens the last of its context (causal among them),
    left pads (query positions that see nothing: zeros), and holes in what the others see."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, h * g, d, generator=gen).to(dtype).transpose(1, 2)
    store_k = torch.randn(b + 1, h, L + 9, d, generator=gen).to(dtype)
    store_v = torch.randn(b + 1, h, L + 9, d, generator=gen).to(dtype)
    k, v = store_k[1:, :, :L], store_v[1:, :, :L]
    lens = torch.randint(max(m, L // 2), L + 1, (b,), generator=gen)
    qpos = lens[:, None] - m + torch.arange(m)[None]
    mask = torch.arange(L)[None, None, :] <= qpos[:, :, None]
    mask &= torch.rand(b, 1, L, generator=gen) < 0.9  # holes: keys no position of the row sees
    mask[0, : m // 3] = False  # a left-padded row
    return q, k, v, mask[:, None]


@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.float32, 2e-6, marks=needs_prefill(torch.float32)),
                                       pytest.param(torch.bfloat16, 2e-2, marks=needs_prefill(torch.bfloat16))])
@pytest.mark.parametrize("g,d,m,L", [(3, 64, 37, 300), (1, 64, 5, 41), (4, 128, 20, 129), (16, 64, 3, 16),
                                     (2, 64, 1, 70), (3, 64, 70, 70)])
def test_the_prefill_kernel_is_sdpa(g, d, m, L, dtype, tol):
    """Tiles of 16 positions and a remainder, blocks of 16 keys and a partial one, rows of G 1-16
    query heads: the model's layout back ([b, M, Hq, D]), zeros where a position sees no key."""
    q, k, v, mask = _prefill_case(3, 2, g, d, m, L, dtype)
    out = cpu_attention.prefill(q, k, v, mask, d ** -0.5)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert out is not None and out.dtype == dtype and out.shape == (3, m, 2 * g, d)
    sees = mask[:, 0].any(-1)  # [b, m]
    assert torch.equal(out[~sees], torch.zeros_like(out[~sees]))
    assert (out.float() - ref.transpose(1, 2)).abs().max().item() <= tol
    if dtype == torch.bfloat16:  # as close to fp32 as SDPA's own bf16
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).float()
        ours = (out.float() - ref.transpose(1, 2)).abs().mean().item()
        assert ours <= 1.25 * (sdpa - ref.transpose(1, 2)).abs().mean().item()


@needs_prefill(torch.float32)
def test_the_prefill_on_one_thread_and_two_agree_exactly():
    q, k, v, mask = _prefill_case(4, 3, 3, 64, 40, 400, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.prefill(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.prefill(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (row, head, tile) is one thread's


@needs_prefill(torch.float32)
def test_what_the_prefill_kernel_does_not_take_is_left_to_sdpa():
    q, k, v, mask = _prefill_case(2, 2, 3, 64, 5, 40, torch.float32)
    assert cpu_attention.prefill(q.half(), k.half(), v.half(), mask, 0.125) is None  # fp16
    assert cpu_attention.prefill(q, k.double(), v, mask, 0.125) is None  # mixed dtypes
    assert cpu_attention.prefill(q, k, v, mask.float(), 0.125) is None  # not a boolean mask
    assert cpu_attention.prefill(q, k, v, None, 0.125) is None
    q80, k80, v80, mask80 = _prefill_case(2, 2, 3, 80, 5, 40, torch.float32)
    assert cpu_attention.prefill(q80, k80, v80, mask80, 0.125) is None  # a head size it has no registers for
    big = torch.zeros(2, 17, 5, 64)
    assert cpu_attention.prefill(big, k[:, :1], v[:, :1], mask, 0.125) is None  # G > 16
    assert cpu_attention.prefill_unavailable(torch.float16, 64) == "the prefill kernel runs fp32 and bf16, not float16"
    assert cpu_attention.prefill_unavailable(torch.float32, 80) == "the prefill kernel runs head sizes 64 and 128, not 80"


@needs_prefill(torch.float32)
def test_slot_attention_runs_the_prefill_kernel_only_inside_a_kernel_call(monkeypatch, tiny_model):
    calls = []
    real = cpu_attention.prefill
    monkeypatch.setattr(cpu_attention, "prefill", lambda *a: calls.append(a[0].shape) or real(*a))
    q, k, v, mask = _prefill_case(2, 2, 2, 64, 6, 50, torch.float32)
    plain, _ = slot_attention(None, q, k, v, mask, scaling=0.125)
    assert calls == []
    with use_slot_attention(tiny_model, prefill_kernel=True):
        fast, _ = slot_attention(None, q, k, v, mask, scaling=0.125)
        slot_attention(None, q[:, :, :1], k, v, mask[:, :, :1], scaling=0.125)  # a decode step: SDPA
    assert calls == [(2, 4, 6, 64)]
    assert fast.shape == plain.shape == (2, 6, 4, 64) and torch.allclose(fast, plain, atol=1e-6)
    slot_attention(None, q, k, v, mask, scaling=0.125)
    assert len(calls) == 1  # the setting ends with the block


@needs_prefill(torch.float32)
def test_the_samplers_logprobs_with_both_kernels_are_a_teacher_forced_forwards(monkeypatch, head64_model, tokenizer):
    """fp32: each reply's log-probs, greedy and sampled, equal a teacher-forced forward of the same
    tokens (SDPA over the whole sequence) to 1e-5, over a first turn (shared prefixes, left pads)
    and a reused one, with every prefill and every decode step through the kernel."""
    calls = {"prefill": 0, "decode": 0}  # the kernel's calls that it answered (None: SDPA ran)

    def counted(name, real):
        def call(*a):
            out = real(*a)
            calls[name] += out is not None
            return out
        return call

    for name in calls:
        monkeypatch.setattr(cpu_attention, name, counted(name, getattr(cpu_attention, name)))
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in
               ["Thought: short", "a somewhat longer prompt so that left padding matters here", "x"]]
    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=10), SamplingParams(temperature=1.0, max_new_tokens=8)
    sampler = HFSampler(head64_model, tokenizer, decode_attention="kernel", prefill_attention="kernel")
    assert sampler.prefill_kernel is True
    assert HFSampler(head64_model, tokenizer, prefill_attention="sdpa").prefill_kernel is False
    first = sampler.generate(rows(prompts, keys=["a", "b", "c"]), greedy)
    turn = [p + c.token_ids + prompts[0] for p, c in zip(prompts, first)]
    second = sampler.generate(rows(turn, seeds=[1, 2, 3], keys=["a", "b", "c"]), sampled)
    layers = head64_model.config.num_hidden_layers
    assert calls["prefill"] >= 2 * layers and calls["prefill"] % layers == 0  # every layer of every prefill
    assert calls["decode"] and calls["decode"] % layers == 0
    for prompt, c in zip(prompts + turn, first + second):
        assert c.logprobs == pytest.approx(_teacher_forced(head64_model, prompt, c.token_ids), abs=1e-5)


@needs_prefill(torch.float32)
def test_the_prefill_setting_decides_once_and_refuses_in_one_line(fresh_build, monkeypatch, caplog, head64_model,
                                                                 tiny_model):
    config = head64_model.config
    assert prefill_kernel_for("auto", "auto", "cpu", torch.float32, config) is True
    assert prefill_kernel_for("sdpa", "auto", "cpu", torch.float32, config) is False
    assert prefill_kernel_for("auto", "math", "cpu", torch.float32, config) is False  # a pinned SDPA kernel runs
    assert prefill_kernel_for("auto", "auto", "cuda", torch.bfloat16, config) is False
    with pytest.raises(UserError, match=r"^sampling.prefill_attention=kernel: agentrl's prefill kernel runs on a CPU, "
                                        r"this sampler on cuda; choose auto or sdpa$"):
        prefill_kernel_for("kernel", "auto", "cuda", torch.float32, config)
    with pytest.raises(UserError, match=r"^sampling.prefill_attention=kernel: the prefill kernel runs head sizes 64 "
                                        r"and 128, not 16; choose auto or sdpa$"):
        prefill_kernel_for("kernel", "auto", "cpu", torch.float32, tiny_model.config)
    with caplog.at_level("INFO"):
        assert prefill_kernel_for("auto", "auto", "cpu", torch.float32, tiny_model.config) is False
    assert "prefills run SDPA's attention: the prefill kernel runs head sizes 64 and 128, not 16" in caplog.text
    cpu_attention.load.cache_clear()
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with pytest.raises(UserError) as e:
        prefill_kernel_for("kernel", "auto", "cpu", torch.float32, config)
    assert "\n" not in str(e.value) and "no-such-compiler does not run" in str(e.value)
    from agentrl.config import load_config

    with pytest.raises(UserError, match="^sampling.prefill_attention must be one of auto, kernel, sdpa, got 'x'$"):
        load_config(None, {"sampling.prefill_attention": "x"})
    assert load_config(None, {}).sampling.prefill_attention == "auto"
