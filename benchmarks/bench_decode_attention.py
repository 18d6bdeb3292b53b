"""A decode step's attention on the CPU: agentrl's kernel (sampling/cpu_attention.py) against SDPA
(a script, not a test).

1. The op: one decode step's attention of the default model's shape (3 KV heads, 3 query heads
   each, head size 64) over `--rows` rows × `--lengths` keys of views of a slot store, every row's
   keys unmasked from 50% to 100% of the length, fp32 and bf16 (bf16 only where the CPU has bf16
   matmuls, or with --bf16). Each call follows a small matmul, as in the model (torch's OpenMP
   threads are then awake). SDPA and the kernel alternate, the best of `--repeats` runs of
   `--calls` calls each: ms a call, the ratio, GB/s of K and V read (unmasked keys only), and the
   largest difference from SDPA.
2. `--eval N,STEPS`: `agentrl eval` of the first N valid_seen games at T_max STEPS with `--config`
   (default configs/default.yaml; `--dtype` overrides its model.dtype) and `--adapter`, with
   `sampling.decode_attention` sdpa and then auto (the kernel; `--arms auto,sdpa` the other way
   round), one after the other in this process: wall seconds, generate seconds, the ratio, and whether every episode's actions match.

Usage:
    python benchmarks/bench_decode_attention.py                   # the op
    python benchmarks/bench_decode_attention.py --eval 16,20 --dtype float32
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F


def best_ms(fn, calls: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1000


def bench_op(rows: list[int], lengths: list[int], dtypes: list[torch.dtype], calls: int, repeats: int) -> None:
    from agentrl.sampling import cpu_attention

    cpu_attention.load()
    print("| dtype | rows | keys | SDPA ms | kernel ms | ratio | SDPA GB/s | kernel GB/s | largest difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    hkv, g, d = 3, 3, 64
    for dtype in dtypes:
        for b in rows:
            for L in lengths:
                gen = torch.Generator().manual_seed(0)
                store_k = torch.randn(b, hkv, L + 256, d, generator=gen).to(dtype)  # a store with room to grow
                store_v = torch.randn(b, hkv, L + 256, d, generator=gen).to(dtype)
                k, v = store_k[:, :, :L], store_v[:, :, :L]
                q = torch.randn(b, hkv, g, d, generator=gen).to(dtype)
                lens = torch.randint(L // 2, L + 1, (b,), generator=gen)
                mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]
                w, x = torch.randn(576, 576, dtype=dtype), torch.randn(b, 576, dtype=dtype)
                sdpa = best_ms(lambda: (x @ w, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), calls, repeats)
                kernel = best_ms(lambda: (x @ w, cpu_attention.decode(q, k, v, mask, d ** -0.5)), calls, repeats)
                matmul = best_ms(lambda: x @ w, calls, repeats)
                sdpa, kernel = sdpa - matmul, kernel - matmul
                read = 2 * hkv * d * k.element_size() * int(lens.sum())
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                diff = (cpu_attention.decode(q, k, v, mask, d ** -0.5).float() - ref.float()).abs().max().item()
                name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {b} | {L} | {sdpa:.2f} | {kernel:.2f} | {sdpa / kernel:.2f}x | "
                      f"{read / sdpa / 1e6:.1f} | {read / kernel / 1e6:.1f} | {diff:.1e} |")


def bench_eval(spec: str, config: str, adapter: str | None, dtype: str | None, arms: list[str]) -> None:
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval

    limit, steps = (int(x) for x in spec.split(","))
    overrides = {"eval.limit": limit, "eval.max_steps": steps, "model.adapter": adapter}
    if dtype:
        overrides["model.dtype"] = dtype
    results = {}
    for arm in arms:
        cfg = load_config(config, {**overrides, "sampling.decode_attention": arm})
        start = time.perf_counter()
        result = run_eval(cfg)
        wall = time.perf_counter() - start
        actions = [[s.action for s in t.steps] for t in result.trajectories]
        won = sum(t.won for t in result.trajectories)
        results[arm] = (wall, result.stats.generate_s, actions)
        print(f"decode attention {arm}: {wall:.1f} s (generate {result.stats.generate_s:.1f} s), won {won}/{limit}")
    (w0, g0, a0), (w1, g1, a1) = results["sdpa"], results["auto"]
    same = sum(x == y for x, y in zip(a0, a1))
    print(f"eval of {limit} games x T_max {steps} ({config}, dtype {cfg.model.dtype}): SDPA -> kernel {w0:.1f} -> "
          f"{w1:.1f} s ({w0 / w1:.2f}x), generate {g0:.1f} -> {g1:.1f} s ({g0 / g1:.2f}x); episodes with the same "
          f"actions: {same}/{limit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,48")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="bf16 even where the CPU emulates it")
    ap.add_argument("--eval", default=None, help="N,STEPS: an eval of N valid_seen games at T_max STEPS, SDPA then the kernel")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--dtype", default=None, help="the eval's model.dtype (default: the config's)")
    ap.add_argument("--arms", default="sdpa,auto", help="the evals' order (auto,sdpa: the kernel first)")
    args = ap.parse_args()
    from agentrl.models import native_bf16

    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or native_bf16("cpu") else [])
    bench_op([int(r) for r in args.rows.split(",")], [int(n) for n in args.lengths.split(",")], dtypes, args.calls,
             args.repeats)
    if args.eval:
        bench_eval(args.eval, args.config, args.adapter, args.dtype, args.arms.split(","))


if __name__ == "__main__":
    main()
