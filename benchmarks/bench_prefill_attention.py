"""A prefill's attention on the CPU: agentrl's kernel (sampling/cpu_attention.py) against SDPA (a
script, not a test).

1. The op: M new tokens of each of `--rows` rows over L keys (`--shapes rows x M x L`: shapes an
   eval of `make train`'s warm start runs), the default model's heads (3 KV heads, 3 query heads
   each, head size 64), the queries in the model's layout, K and V views of a slot store, each
   row's M tokens the last of its context (its length drawn from L/2 to L; causal among them),
   fp32 and bf16 (bf16 only where the CPU has bf16 matmuls, or with --bf16). SDPA and the kernel
   alternate, the best of `--repeats` runs: ms a call, the ratio, GFLOP/s counting every
   (query, key) pair as SDPA computes them, and each one's largest difference from SDPA in fp32.
2. `--eval N,STEPS`: `agentrl eval` of the first N valid_seen games at T_max STEPS with `--config`
   (default configs/default.yaml; `--dtype` overrides its model.dtype) and `--adapter`, with
   `sampling.prefill_attention` sdpa and then auto (the kernel; `--arms auto,sdpa` the other way
   round), decode steps through the decode kernel in both, each arm in a fresh process, one after
   the other: wall seconds, generate seconds, the ratio, and whether every episode's actions match.

Usage:
    python benchmarks/bench_prefill_attention.py                   # the op
    python benchmarks/bench_prefill_attention.py --eval 16,20 --adapter WS
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F
from bench_decode_attention import best_ms  # the best of `repeats` runs of `calls` calls, ms a call

SHAPES = "5x240x512,7x96x768,6x32x1024,12x16x768,1x339x339,16x64x2048,3x2x700"


def bench_op(shapes: list[tuple[int, int, int]], dtypes: list[torch.dtype], repeats: int) -> None:
    from agentrl.sampling import cpu_attention

    cpu_attention.load()
    print("| dtype | rows x new tokens x keys | SDPA ms | kernel ms | ratio | SDPA GFLOP/s | kernel GFLOP/s | "
          "largest difference from fp32: SDPA / kernel |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    hkv, g, d = 3, 3, 64
    for dtype in dtypes:
        for b, m, L in shapes:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, m, hkv * g, d, generator=gen).to(dtype).transpose(1, 2)  # the model's layout
            store_k = torch.randn(b, hkv, L + 256, d, generator=gen).to(dtype)  # a store with room to grow
            store_v = torch.randn(b, hkv, L + 256, d, generator=gen).to(dtype)
            k, v = store_k[:, :, :L], store_v[:, :, :L]
            lens = torch.randint(max(m, L // 2), L + 1, (b,), generator=gen)
            qpos = lens[:, None] - m + torch.arange(m)[None]
            mask = (torch.arange(L)[None, None, :] <= qpos[:, :, None])[:, None]

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).contiguous()

            def kernel():
                return cpu_attention.prefill(q, k, v, mask, d ** -0.5)

            a, c = best_ms(sdpa, 5, repeats), best_ms(kernel, 5, repeats)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 enable_gqa=True).transpose(1, 2)
            da = (sdpa().float() - ref).abs().max().item()
            dc = (kernel().float() - ref).abs().max().item()
            flops = 4 * b * hkv * g * m * L * d
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {b} x {m} x {L} | {a:.2f} | {c:.2f} | {a / c:.2f}x | {flops / a / 1e6:.0f} | "
                  f"{flops / c / 1e6:.0f} | {da:.1e} / {dc:.1e} |", flush=True)


def eval_arm(spec: str, config: str, adapter: str | None, dtype: str | None, arm: str) -> dict:
    """One arm's eval in this process: wall and generate seconds, games won, each episode's actions."""
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval

    limit, steps = (int(x) for x in spec.split(","))
    overrides = {"eval.limit": limit, "eval.max_steps": steps, "model.adapter": adapter,
                 "sampling.prefill_attention": arm}
    if dtype:
        overrides["model.dtype"] = dtype
    cfg = load_config(config, overrides)
    start = time.perf_counter()
    result = run_eval(cfg)
    return {"wall": time.perf_counter() - start, "generate": result.stats.generate_s, "dtype": cfg.model.dtype,
            "won": sum(t.won for t in result.trajectories),
            "actions": [[s.action for s in t.steps] for t in result.trajectories]}


def bench_eval(spec: str, config: str, adapter: str | None, dtype: str | None, arms: list[str]) -> None:
    """Each arm in a fresh process (no state of one arm's eval, the heap's or the threads', is
    left to the other), one after the other."""
    import json
    import subprocess
    import sys

    limit = int(spec.split(",")[0])
    results = {}
    for arm in arms:
        cmd = [sys.executable, __file__, "--one-arm", arm, "--eval", spec, "--config", config]
        cmd += ["--adapter", adapter] if adapter else []
        cmd += ["--dtype", dtype] if dtype else []
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[arm] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[arm]
        print(f"prefill attention {arm}: {r['wall']:.1f} s (generate {r['generate']:.1f} s), won {r['won']}/{limit}",
              flush=True)
    a, b = results["sdpa"], results["auto"]
    same = sum(x == y for x, y in zip(a["actions"], b["actions"]))
    print(f"eval of {limit} games x T_max {spec.split(',')[1]} ({config}, dtype {a['dtype']}): SDPA -> kernel "
          f"{a['wall']:.1f} -> {b['wall']:.1f} s ({a['wall'] / b['wall']:.2f}x), generate {a['generate']:.1f} -> "
          f"{b['generate']:.1f} s ({a['generate'] / b['generate']:.2f}x); episodes with the same actions: {same}/{limit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="rows x new tokens x keys, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="bf16 even where the CPU emulates it")
    ap.add_argument("--eval", default=None, help="N,STEPS: an eval of N valid_seen games at T_max STEPS, SDPA then the kernel")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--dtype", default=None, help="the eval's model.dtype (default: the config's)")
    ap.add_argument("--arms", default="sdpa,auto", help="the evals' order (auto,sdpa: the kernel first)")
    ap.add_argument("--no-op", action="store_true", help="the eval only")
    ap.add_argument("--one-arm", default=None, help=argparse.SUPPRESS)  # a child process: one arm's eval as JSON
    args = ap.parse_args()
    if args.one_arm:
        import json

        print(json.dumps(eval_arm(args.eval, args.config, args.adapter, args.dtype, args.one_arm)))
        return
    from agentrl.models import native_bf16

    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_op:
        dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or native_bf16("cpu") else [])
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        bench_op(shapes, dtypes, args.repeats)
    if args.eval:
        bench_eval(args.eval, args.config, args.adapter, args.dtype, args.arms.split(","))


if __name__ == "__main__":
    main()
