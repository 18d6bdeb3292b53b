"""SDPA's kernels side by side on the sampler's attention shapes, then on the model's decode step
(issue 47, item 1; a script, not a test).

1. The op (`agentrl.sampling.kv.slot_attention`, the call every layer makes), for each kernel
   (`auto` = SDPA's own choice, then each pin: cudnn, efficient, math, flash; one that cannot
   run the shape is reported unavailable):
   - decode: `--rows` rows, one query each (the 9 query heads of SmolLM2 folded into 3 rows of
     each of its 3 KV heads), KV length L in `--lengths`, head_dim 64, bf16 on CUDA / fp32 on
     the CPU, the boolean per-row length mask the sampler builds; keys and values are views of
     a larger buffer, as the slot store's are;
     (a) `fixed`: L fixed, `--calls` calls (the per-call cost);
     (b) `grow`: L + 1 at every call (a new shape each call, as a decode step's KV grows: the
         per-new-shape cost, e.g. a kernel plan built per shape), each kernel over lengths of its
         own from L up (a plan cached for a shape under an earlier kernel would flatter the next);
   - prefill: `--prefill-rows` rows of `--prefill-new` new tokens over L keys (4D causal mask,
     enable_gqa), `fixed` only; and the same folded as the decode step folds its heads (no
     enable_gqa: for a kernel that takes no grouped heads).
   Reported per call: host ms (the loop's time before the closing sync: what the CPU spends
   dispatching), wall ms (after it), kernel ms and `GPU busy` = kernel time / wall time (from
   torch.profiler's device events; CUDA only), and each kernel's wall time as a ratio of auto's.
2. The model (`--model default`: the prepared SmolLM2-135M-Instruct, as bench_sampler.py loads it;
   `random`, or when it is not prepared: a random Llama of its shape): an HFSampler per kernel
   (`sampling.attention_backend`), `--model-rows` rows of ~`--context` random tokens; the first
   call prefills them (item 4: seconds and the number of prefill forwards; each kernel's rows 5% of
   --context shorter than the last kernel's, for the same reason), then `--steps` calls
   each append 50 tokens and decode `--new-tokens` (KV kept): seconds per step, ms per token.
`--profile DIR` writes, per kernel, the profiler's top ops of one decode call by self CPU time and
by device time (DIR/profile_<kernel>.txt). `--out FILE` writes every number as JSON.

Usage: python benchmarks/bench_attention.py [--device auto|cpu|cuda] [--rows 128]
           [--lengths 512,1024,2048] [--calls 50] [--prefill-rows 8] [--prefill-new 512]
           [--kernels auto,cudnn,efficient,math,flash] [--model default|random|none]
           [--model-rows 128] [--context 2048] [--new-tokens 30] [--steps 3] [--profile DIR] [--out FILE]
On the CPU (no GPU) only auto, math and flash run; the defaults there are smaller (see --help).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

KERNELS = ("auto", "cudnn", "efficient", "math", "flash")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention


# ---------------------------------------------------------------- timing


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_ms(prof) -> float:
    """Device (kernel) time the profiler saw, ms: the union of the device events' intervals (the sum
    of every event's self device time, used before, counted kernels more than once: GPU busy above
    100% in the H100 run of 2026-11-27)."""
    from agentrl.gpucheck import kernel_seconds

    return 1e3 * (kernel_seconds(prof) or 0.0)


def time_calls(calls, device) -> dict:
    """Host ms per call (the loop's time before the closing sync: dispatch) and wall ms per call."""
    _sync(device)
    t0 = time.perf_counter()
    for f in calls:
        f()
    host = time.perf_counter() - t0
    _sync(device)
    wall = time.perf_counter() - t0
    return {"host_ms": 1e3 * host / len(calls), "wall_ms": 1e3 * wall / len(calls)}


def profile_calls(calls, device) -> dict:
    """On CUDA: kernel ms per call and GPU busy (kernel time / wall time) from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for f in calls:
            f()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    kernel = _kernel_ms(prof)
    return {"kernel_ms": kernel / len(calls), "gpu_busy": kernel / (1e3 * wall)}


# ---------------------------------------------------------------- the op


def _decode_inputs(rows: int, L: int, cap: int, device, dtype, seed: int = 0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    buf = torch.randn((rows, KV_HEADS, cap, HEAD_DIM), generator=g).to(device, dtype)
    q = torch.randn((rows, HEADS, 1, HEAD_DIM), generator=g).to(device, dtype)
    lengths = torch.randint(max(1, L // 2), L + 1, (rows,), generator=g).to(device)
    return buf, q, lengths


def _decode_mask(lengths, L: int):
    import torch

    keys = torch.arange(L, device=lengths.device)
    return (keys[None, None, :] < lengths[:, None, None])[:, None]  # [b, 1, 1, L], as HFSampler._forward builds it


def op_decode(kernel: str, rows: int, L: int, calls: int, grow: bool, device, dtype, profile: bool) -> dict:
    """slot_attention's decode call under one kernel: `calls` calls at L, or at L, L+1, ... (grow)."""
    import torch

    from agentrl.sampling.attention import sdpa_backend
    from agentrl.sampling.kv import slot_attention

    # grow: the timed pass and the profiled pass each see shapes no call has seen before, in this
    # kernel's own range: a plan cached per shape by an earlier kernel's calls (cuDNN's, built on
    # each new length under `auto`) must not make a later kernel's calls look cheap
    first = L + 2 * calls * KERNELS.index(kernel) if grow else L
    sizes = [first + i for i in range(calls)] if grow else [L] * calls
    again = [first + calls + i for i in range(calls)] if grow else sizes
    buf, q, lengths = _decode_inputs(rows, L, first + 2 * calls, device, dtype)
    masks = {n: _decode_mask(lengths, n) for n in {L - 1, *sizes, *again}}  # built beforehand: a forward builds it once, not per layer
    step = lambda n: lambda: slot_attention(None, q, buf[:, :, :n], buf[:, :, :n], masks[n], scaling=HEAD_DIM ** -0.5)  # noqa: E731
    with torch.no_grad(), sdpa_backend(kernel):
        step(L - 1)()  # warm-up (and the availability check: a kernel that cannot run raises here)
        if not grow:
            step(L)()
        out = time_calls([step(n) for n in sizes], device)
        return {**out, **profile_calls([step(n) for n in again], device)} if profile else out


def op_prefill(kernel: str, rows: int, new: int, L: int, calls: int, device, dtype, profile: bool,
               fold: bool = False) -> dict:
    """slot_attention's prefill call: rows x `new` new tokens over L keys, causal per row, enable_gqa.
    `fold`: instead, the decode step's layout (the g query heads of a KV head as g blocks of query
    rows, the mask repeated g times, no enable_gqa): a candidate for kernels without grouped heads."""
    import torch
    import torch.nn.functional as F

    from agentrl.sampling.attention import sdpa_backend
    from agentrl.sampling.kv import slot_attention

    buf, _, _ = _decode_inputs(rows, L, L, device, dtype)
    q = torch.randn((rows, HEADS, new, HEAD_DIM)).to(device, dtype)
    keys = torch.arange(L, device=device)
    qpos = torch.arange(L - new, L, device=device)[None].expand(rows, new)
    mask = (keys[None, None, :] <= qpos[:, :, None])[:, None]  # [b, 1, M, L]
    step = lambda: slot_attention(None, q, buf, buf, mask, scaling=HEAD_DIM ** -0.5)  # noqa: E731
    if fold:
        g = HEADS // KV_HEADS
        qf = q.reshape(rows, KV_HEADS, g * new, HEAD_DIM)
        mf = mask[:, :, None].expand(rows, 1, g, new, L).reshape(rows, 1, g * new, L)
        step = lambda: F.scaled_dot_product_attention(qf, buf, buf, attn_mask=mf, scale=HEAD_DIM ** -0.5)  # noqa: E731
    with torch.no_grad(), sdpa_backend(kernel):
        step()
        out = time_calls([step] * calls, device)
        return {**out, **profile_calls([step] * calls, device)} if profile else out


def default_choice(device, dtype, rows: int, L: int) -> dict:
    """Which kernel SDPA's own dispatch picks for each shape (torch._fused_sdp_choice; private)."""
    import torch
    from torch.nn.attention import SDPBackend

    q1 = torch.zeros((rows, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), device=device, dtype=dtype)
    qm = torch.zeros((rows, HEADS, 16, HEAD_DIM), device=device, dtype=dtype)
    k = torch.zeros((rows, KV_HEADS, L, HEAD_DIM), device=device, dtype=dtype)
    out = {}
    try:
        m1 = torch.ones((rows, 1, 1, L), dtype=torch.bool, device=device)
        mm = torch.ones((rows, 1, 16, L), dtype=torch.bool, device=device)
        out["decode"] = SDPBackend(torch._fused_sdp_choice(q1, k, k, m1, 0.0, False, scale=None, enable_gqa=False)).name
        out["prefill"] = SDPBackend(torch._fused_sdp_choice(qm, k, k, mm, 0.0, False, scale=None, enable_gqa=True)).name
    except (RuntimeError, TypeError, AttributeError) as e:
        out["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return out


def run_op(args, device, dtype) -> dict:
    """Every kernel on every op shape; a kernel that cannot run a shape is recorded as unavailable."""
    results: dict = {"default_choice": default_choice(device, dtype, args.rows, max(args.lengths))}
    print(f"SDPA's own choice here: {results['default_choice']}")
    cases = [(f"decode fixed L={L}", lambda k, L=L: op_decode(k, args.rows, L, args.calls, False, device, dtype, True))
             for L in args.lengths]
    cases += [(f"decode grow L={L}+", lambda k, L=L: op_decode(k, args.rows, L, args.calls, True, device, dtype, True))
              for L in args.lengths]
    L = max(args.lengths)
    cases.append((f"prefill {args.prefill_rows}x{args.prefill_new} L={L}",
                  lambda k: op_prefill(k, args.prefill_rows, args.prefill_new, L, max(3, args.calls // 10), device, dtype, True)))
    cases.append((f"prefill folded (no enable_gqa) {args.prefill_rows}x{args.prefill_new} L={L}",
                  lambda k: op_prefill(k, args.prefill_rows, args.prefill_new, L, max(3, args.calls // 10), device, dtype,
                                       True, fold=True)))
    for name, fn in cases:
        row = {}
        for k in args.kernels:
            try:
                row[k] = fn(k)
            except RuntimeError as e:
                row[k] = {"unavailable": (str(e).strip().splitlines() or [type(e).__name__])[0][:120]}
        results[name] = row
        print_row(name, row, args.kernels)
    return results


def print_row(name: str, row: dict, kernels) -> None:
    base = row.get("auto", {}).get("wall_ms")
    print(f"\n{name}")
    print(f"  {'kernel':<10} {'host ms':>9} {'wall ms':>9} {'kernel ms':>9} {'GPU busy':>8} {'wall/auto':>9}")
    for k in kernels:
        r = row[k]
        if "unavailable" in r:
            print(f"  {k:<10} unavailable: {r['unavailable']}")
            continue
        kern = f"{r['kernel_ms']:9.4f}" if r.get("kernel_ms") is not None else f"{'-':>9}"
        busy = f"{100 * r['gpu_busy']:7.1f}%" if r.get("gpu_busy") is not None else f"{'-':>8}"
        ratio = f"{r['wall_ms'] / base:9.2f}" if base else f"{'-':>9}"
        print(f"  {k:<10} {r['host_ms']:9.4f} {r['wall_ms']:9.4f} {kern} {busy} {ratio}")


# ---------------------------------------------------------------- the model


def load(kind: str, device: str):
    """(model, model's name): the prepared default model, or a random Llama of its shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.models import is_prepared, load_model

    if kind == "default" and is_prepared():
        model, _ = load_model("default", "auto", device)
        return model, "SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return LlamaForCausalLM(config).to(device, dtype).eval(), "random Llama of SmolLM2-135M's shape"


def model_step(model, kernel: str, args, device, profile_dir: Path | None) -> dict:
    """An HFSampler pinned to `kernel`: a prefill of every row's context, then `steps` lockstep calls."""
    import torch

    from agentrl.sampling.base import GenRequest, SamplingParams
    from agentrl.sampling.hf import HFSampler

    tok = _NoTokenizer()
    sampler = HFSampler(model, tok, batch_size=args.model_rows, attention_backend=kernel)
    sampler.stop_ids = set()  # every row decodes the full length
    forwards = {"prefill": 0}
    run_bucket = sampler._prefill_bucket

    def counted(*a, **kw):
        forwards["prefill"] += 1
        return run_bucket(*a, **kw)

    sampler._prefill_bucket = counted
    g = torch.Generator().manual_seed(0)
    rows, params = args.model_rows, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    # each kernel's rows have lengths of their own (a shape seen under an earlier kernel may have its plan cached)
    shift = args.context // 20 * KERNELS.index(kernel)
    prompts = [torch.randint(100, 49000, (args.context - r % 97 - shift,), generator=g).tolist() for r in range(rows)]
    keys = list(range(rows))
    call = lambda s: sampler.generate([GenRequest(p, seed=s * rows + k, key=k) for p, k in zip(prompts, keys)], params)  # noqa: E731
    _sync(device)
    t0 = time.perf_counter()
    out = call(0)
    _sync(device)
    first, first_forwards = time.perf_counter() - t0, forwards["prefill"]
    times = []
    for s in range(1, args.steps + 1):
        prompts = [p + c.token_ids + torch.randint(100, 49000, (50,), generator=g).tolist() for p, c in zip(prompts, out)]
        _sync(device)
        t0 = time.perf_counter()
        out = call(s)
        _sync(device)
        times.append(time.perf_counter() - t0)
    if profile_dir is not None:
        write_profile(profile_dir / f"profile_{kernel}.txt", lambda: call(args.steps + 1), device)
    sampler.release(keys)
    del sampler
    if device.type == "cuda":  # the next kernel's sampler sizes its KV budget from free memory
        torch.cuda.empty_cache()
    step = sum(times) / len(times)
    return {"first_call_s": first, "prefill_forwards": first_forwards, "s_per_step": step,
            "ms_per_token": 1e3 * step / args.new_tokens, "tokens_per_s": rows * args.new_tokens / step}


class _NoTokenizer:
    """What HFSampler asks of a tokenizer when the prompts are ids already."""

    eos_token_id, pad_token_id = 0, 0

    def convert_tokens_to_ids(self, name):
        return None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return ""


def write_profile(path: Path, fn, device) -> None:
    """The top ops of one call, by self CPU time and by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fn()
        _sync(device)
    table = prof.key_averages()
    text = "by self CPU time\n" + table.table(sort_by="self_cpu_time_total", row_limit=15)
    if device.type == "cuda":
        key = "self_device_time_total" if hasattr(table[0], "self_device_time_total") else "self_cuda_time_total"
        text += "\nby device time\n" + table.table(sort_by=key, row_limit=15)
        text += f"\nkernel time {_kernel_ms(prof):.2f} ms\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"  profile: {path}")


def run_model(args, device) -> dict:
    from agentrl.errors import UserError

    model, name = load(args.model, str(device))
    print(f"\nthe model's decode step ({name}): {args.model_rows} rows x ~{args.context} tokens, "
          f"{args.new_tokens} new tokens per call, {args.steps} calls after the first (prefill) call")
    print(f"  {'kernel':<10} {'first call s':>12} {'prefill fwd':>11} {'s/step':>8} {'ms/token':>9} {'tok/s':>9} {'step/auto':>9}")
    results: dict = {"model": name}
    for k in args.kernels:
        try:
            r = model_step(model, k, args, device, Path(args.profile) if args.profile else None)
        except UserError as e:
            results[k] = {"unavailable": str(e)}
            print(f"  {k:<10} unavailable: {e}")
            continue
        results[k] = r
        base = results.get("auto", {}).get("s_per_step")
        print(f"  {k:<10} {r['first_call_s']:12.3f} {r['prefill_forwards']:11d} {r['s_per_step']:8.3f} "
              f"{r['ms_per_token']:9.3f} {r['tokens_per_s']:9.1f} " + (f"{r['s_per_step'] / base:9.2f}" if base else f"{'-':>9}"))
    return results


# ---------------------------------------------------------------- main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--rows", type=int, default=None, help="decode rows (default 128 on CUDA, 16 on the CPU)")
    ap.add_argument("--lengths", default=None, help="KV lengths (default 512,1024,2048 on CUDA, 256,512 on the CPU)")
    ap.add_argument("--calls", type=int, default=None, help="calls per measurement (default 50 on CUDA, 10 on the CPU)")
    ap.add_argument("--prefill-rows", type=int, default=None, help="(default 8 on CUDA, 2 on the CPU)")
    ap.add_argument("--prefill-new", type=int, default=None, help="(default 512 on CUDA, 64 on the CPU)")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--model", choices=("default", "random", "none"), default="default")
    ap.add_argument("--model-rows", type=int, default=None, help="(default 128 on CUDA, 4 on the CPU)")
    ap.add_argument("--context", type=int, default=None, help="(default 2048 on CUDA, 256 on the CPU)")
    ap.add_argument("--new-tokens", type=int, default=None, help="(default 30 on CUDA, 8 on the CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", default=None, help="a directory for the profiler tables")
    ap.add_argument("--out", default=None, help="a JSON file for every number")
    args = ap.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not args.kernels or any(k not in KERNELS for k in args.kernels):
        ap.error(f"--kernels: choose from {', '.join(KERNELS)}")
    return args


def main(argv=None) -> dict:
    import torch

    args = parse(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device here", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    big = lambda v, gpu, cpu: v if v is not None else (gpu if cuda else cpu)  # noqa: E731
    args.rows, args.calls = big(args.rows, 128, 16), big(args.calls, 50, 10)
    args.lengths = [int(x) for x in big(args.lengths, "512,1024,2048", "256,512").split(",")]
    args.prefill_rows, args.prefill_new = big(args.prefill_rows, 8, 2), big(args.prefill_new, 512, 64)
    args.model_rows, args.context = big(args.model_rows, 128, 4), big(args.context, 2048, 256)
    args.new_tokens = big(args.new_tokens, 30, 8)
    gpu = torch.cuda.get_device_name(device) if cuda else None
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {gpu or 'CPU'}, {str(dtype).removeprefix('torch.')}")
    results = {"machine": {"gpu": gpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "date": time.strftime("%Y-%m-%d %H:%M")},
               "args": {k: v for k, v in vars(args).items()}, "op": run_op(args, device, dtype)}
    if args.model != "none":
        results["model"] = run_model(args, device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nresults: {args.out}")
    return results


if __name__ == "__main__":
    main()
