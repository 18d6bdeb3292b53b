"""The attention kernel setting (sampling.attention_backend), the prefill's forward sizing and the
decode floor of `doctor --gpu` (issue 47, items 1, 4 and 8), on the CPU; bench_attention runs."""

import importlib.util
from pathlib import Path

import pytest
import torch

from agentrl.errors import UserError
from agentrl.gpucheck import decode_floor, memory_bandwidth
from agentrl.sampling.attention import SCORE_BYTES, prefill_fits, prefill_sizer, sdpa_backend, token_bytes
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler, _length_buckets
from scripted import rows

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's kernels")


def _flags():
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


def test_a_pin_holds_inside_the_block_only_and_auto_changes_nothing():
    before = _flags()
    with sdpa_backend("math"):
        assert _flags() == (False, False, True, False)
    assert _flags() == before
    with pytest.raises(ZeroDivisionError), sdpa_backend("flash"):
        assert _flags() == (True, False, False, False)
        1 / 0
    assert _flags() == before  # restored after an exception too
    with sdpa_backend("auto"):
        assert _flags() == before


def test_an_unknown_kernel_is_one_line():
    from agentrl.config import load_config

    with pytest.raises(UserError, match="^sampling.attention_backend must be one of auto, cudnn, efficient, math, flash, got 'fast'$"):
        load_config(None, {"sampling.attention_backend": "fast"})
    with pytest.raises(UserError, match="got 'fast'"), sdpa_backend("fast"):
        pass


@pytest.fixture
def prompts(tokenizer):
    texts = ["Thought: short", "a somewhat longer prompt so that left padding matters here"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@cpu_only
@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_a_pinned_kernel_samples_as_sdpas_own_choice(tiny_model, tokenizer, prompts, kernel):
    """Greedy tokens identical, log-probs equal to float rounding, over a prefill and a reused turn."""
    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=8), SamplingParams(temperature=1.0, max_new_tokens=6)
    out, before = {}, _flags()
    for name in ("auto", kernel):
        sampler = HFSampler(tiny_model, tokenizer, attention_backend=name)
        first = sampler.generate(rows(prompts, keys=["a", "b"]), greedy)
        turn = [p + c.token_ids + prompts[0] for p, c in zip(prompts, first)]
        second = sampler.generate(rows(turn, seeds=[1, 2], keys=["a", "b"]), sampled)
        out[name] = (first, second)
        assert _flags() == before  # nothing stays pinned after a call
    for a, b in zip(out["auto"][0] + out["auto"][1], out[kernel][0] + out[kernel][1]):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@cpu_only
def test_a_kernel_the_device_cannot_run_is_refused_in_one_line_when_the_sampler_starts(tiny_model, tokenizer):
    for kernel in ("cudnn", "efficient"):
        with pytest.raises(UserError) as e:
            HFSampler(tiny_model, tokenizer, attention_backend=kernel)
        msg = str(e.value)
        assert "\n" not in msg and msg.endswith("attention (a decode step) on the CPU (cpu, float32); choose auto or one of math, flash")


def _old_cpu_rule(rows, new, kv, heads):  # the engine's rule before issue 47, for the CPU
    return rows * new * kv * heads * 4 <= 256 << 20


def test_the_cpu_keeps_the_score_cap_and_cuda_sizes_prefill_by_tokens(tiny_model):
    from transformers import LlamaConfig

    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3)
    cpu = prefill_sizer("auto", "cpu", torch.float32, smol)
    assert cpu.keywords["scores"] is True  # the CPU's forwards keep the cap they always had
    for r, new, kv in [(1, 2048, 2048), (2, 2048, 2048), (64, 50, 2100), (128, 50, 2100), (7, 300, 1200), (1, 1, 1)]:
        assert cpu(r, new, kv) == _old_cpu_rule(r, new, kv, 9)
    assert prefill_sizer("math", "cpu", torch.float32, smol).keywords["scores"] is True
    # the prefill: 128 rows of 2k tokens; one row's fp32 scores already near the cap
    lengths = {i: 2048 - (i % 97) for i in range(128)}
    order = sorted(lengths, key=lengths.get)
    length = lengths.get

    def buckets(fits):
        return _length_buckets(order, length, lambda b: fits(len(b), max(map(length, b)), max(map(length, b))))

    assert len(buckets(cpu)) == 128  # one forward per row: what the H100 run measured (14.8 s)
    fused = lambda r, new, kv: prefill_fits(r, new, kv, heads=9, scores=False, mask_bytes=3,  # noqa: E731  bf16 on CUDA
                                            per_token=token_bytes(smol, 2))
    assert len(buckets(fused)) <= 4
    assert SCORE_BYTES == 256 << 20


def test_the_decode_floor_is_bytes_over_bandwidth():
    assert memory_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert memory_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert memory_bandwidth("NVIDIA H200 x1") == 4.8e12
    assert memory_bandwidth("NVIDIA A100-SXM4-80GB") == 2.0e12
    assert memory_bandwidth("NVIDIA A100-SXM4-40GB") is None and memory_bandwidth("CPU (x86_64)") is None
    f = decode_floor(3_000_000_000, 350_000_000, "NVIDIA H100 80GB HBM3 x1")
    assert f == {"bandwidth_tb_s": 3.35, "kv_read_gb": 3.0, "weights_gb": 0.35, "floor_ms_per_token": 1.0}
    assert decode_floor(10, 10, "CPU (x86_64)")["floor_ms_per_token"] is None


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cpu_only
def test_bench_attention_runs_on_the_cpu(tiny_model, capsys):
    """The benchmark runs here (math and flash; cuDNN and efficient reported unavailable), its op part
    at tiny sizes and its model part on the tiny Llama."""
    bench = _bench()
    out = bench.main(["--device", "cpu", "--rows", "2", "--lengths", "16,24", "--calls", "2", "--prefill-rows", "1",
                      "--prefill-new", "4", "--model", "none"])
    row = out["op"]["decode grow L=24+"]
    assert row["math"]["wall_ms"] > 0 and row["auto"]["wall_ms"] > 0 and "unavailable" in row["cudnn"]
    assert out["op"]["default_choice"] == {"decode": "FLASH_ATTENTION", "prefill": "FLASH_ATTENTION"}
    assert "decode fixed L=16" in capsys.readouterr().out
    args = bench.parse(["--kernels", "math", "--model", "random"])
    args.model_rows, args.context, args.new_tokens, args.steps = 2, 24, 3, 1
    r = bench.model_step(tiny_model, "math", args, torch.device("cpu"), None)
    assert r["prefill_forwards"] == 1 and r["s_per_step"] > 0


def test_token_sized_prefill_forwards_sample_as_one_row_forwards(tiny_model, tokenizer):
    """The CUDA rule's larger prefill forwards change nothing: the same rows, prefilled one per
    forward or all in one, give the same tokens and log-probs (checked here on the CPU's kernels)."""
    text = "You arrive at countertop 2. On the countertop 2, you see a butterknife 1, a cellphone 2, and a mug 3. " * 2
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompts = [ids[: 30 + i] for i in range(6)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    out, forwards = {}, {}
    for name, fits in [("one", lambda r, new, kv: r == 1),
                       ("tokens", lambda r, new, kv: prefill_fits(r, new, kv, heads=4, scores=False, per_token=1024))]:
        sampler = HFSampler(tiny_model, tokenizer, share_prefixes=False)  # the prompts share a prefix: run each whole
        sampler._prefill_fits = fits
        calls, run = [], sampler._prefill_bucket
        sampler._prefill_bucket = lambda bucket, *a, run=run, calls=calls: calls.append(len(bucket)) or run(bucket, *a)
        out[name] = sampler.generate(rows(prompts, seeds=list(range(6))), params)
        forwards[name] = calls
    assert forwards == {"one": [1] * 6, "tokens": [6]}
    for a, b in zip(out["one"], out["tokens"]):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
