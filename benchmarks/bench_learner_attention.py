"""The learner's attention on the CPU: agentrl's kernel (train/attention.py) against SDPA, forward
and backward (a script, not a test).

1. The op: the default model's heads (3 KV heads, 3 query heads each, head size 64) over rows of
   the learner's shapes (`--shapes rows x length[p]`: `p` a packed row of three sequences, each
   attending to itself; else one causal sequence a row), fp32 and bf16 (bf16 only where the CPU
   has bf16 matmuls, or with --bf16): SDPA as the learner calls it (is_causal without a mask, the
   block-diagonal boolean mask for a packed row) against the kernel, forward alone and forward +
   backward, the best of `--repeats` runs.
2. `--sft N`: `agentrl sft` of N walkthroughs (`--config`, default configs/default.yaml: bf16
   autocast where the CPU has it) with `learner.attention` sdpa and then auto, each arm in a fresh
   process: the optimizer steps' seconds (the replay left out), the held-out NLL, and the largest
   difference between the two adapters' weights.

Usage:
    python benchmarks/bench_learner_attention.py
    python benchmarks/bench_learner_attention.py --no-op --sft 16
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from bench_decode_attention import best_ms  # the best of `repeats` runs of `calls` calls, ms a call

SHAPES = "1x700,1x1500,2x1500,1x2048p"


def bench_op(shapes: list[str], dtypes: list[torch.dtype], repeats: int) -> None:
    from agentrl.sampling import cpu_attention
    from agentrl.train.attention import KernelAttention, causal_mask

    cpu_attention.load()
    print("| dtype | rows x length | SDPA forward ms | kernel forward ms | ratio | SDPA forward + backward ms | "
          "kernel forward + backward ms | ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in dtypes:
        for spec in shapes:
            packed = spec.endswith("p")
            b, L = (int(x) for x in spec.rstrip("p").split("x"))
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, L, 9, 64, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
            k = torch.randn(b, 3, L, 64, generator=gen).to(dtype).requires_grad_()
            v = torch.randn(b, 3, L, 64, generator=gen).to(dtype).requires_grad_()
            dout = torch.randn(b, L, 9, 64, generator=gen).to(dtype)
            mask = causal_mask(b, L, L)
            if packed:
                seg = torch.arange(L) * 3 // L
                mask = mask & (seg[:, None] == seg[None, :])

            def sdpa():
                if packed:  # transformers' sdpa: the block-diagonal mask, K and V repeated per query head
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

            def kernel():
                return KernelAttention.apply(q, k, v, mask, 0.125)

            times = []
            for fn in (sdpa, kernel):
                with torch.no_grad():
                    times.append(best_ms(fn, 3, repeats))
                times.append(best_ms(lambda: fn().backward(dout), 3, repeats))
            name = str(dtype).removeprefix("torch.")
            label = f"{b} x {L}" + (" (3 sequences)" if packed else "")
            print(f"| {name} | {label} | {times[0]:.1f} | {times[2]:.1f} | {times[0] / times[2]:.2f}x | {times[1]:.1f} | "
                  f"{times[3]:.1f} | {times[1] / times[3]:.2f}x |", flush=True)


def sft_arm(games: int, config: str, arm: str, out: str) -> dict:
    """One arm's `agentrl sft` in this process: the seconds of its optimizer steps (and held-out
    NLL passes) alone, the walkthrough replay (cached after the first arm) left out."""
    from pathlib import Path

    from agentrl.config import load_config
    from agentrl.train import sft

    cfg = load_config(config, {"sft.games": games, "learner.attention": arm})
    spent = []
    real = sft.train_epochs

    def timed(*a, **k):
        start = time.perf_counter()
        rows = real(*a, **k)
        spent.append(time.perf_counter() - start)
        return rows

    sft.train_epochs = timed
    summary = sft.run_sft(cfg, Path(out), force=True)
    return {"steps_s": spent[0], "heldout_nll": summary["heldout_nll"]["after"],
            "optimizer_steps": summary["sft"]["optimizer_steps"]}


def bench_sft(games: int, config: str) -> None:
    from safetensors.torch import load_file

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("sdpa", "auto"):
            cmd = [sys.executable, __file__, "--one-arm", arm, "--sft", str(games), "--config", config,
                   "--out", f"{tmp}/{arm}"]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[arm] = json.loads(done.stdout.strip().splitlines()[-1])
            r = results[arm]
            print(f"learner attention {arm}: {r['optimizer_steps']} optimizer steps in {r['steps_s']:.1f} s, held-out NLL "
                  f"{r['heldout_nll']:.4f}", flush=True)
        a, b = load_file(f"{tmp}/sdpa/adapter_model.safetensors"), load_file(f"{tmp}/auto/adapter_model.safetensors")
        diff = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
        scale = max(a[n].float().abs().max().item() for n in a)
    w0, w1 = results["sdpa"]["steps_s"], results["auto"]["steps_s"]
    print(f"sft of {games} walkthroughs ({config}): SDPA -> kernel {w0:.1f} -> {w1:.1f} s ({w0 / w1:.2f}x); the adapters' "
          f"largest difference {diff:.1e} (largest weight {scale:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bf16 even where the CPU emulates it")
    ap.add_argument("--sft", type=int, default=None, help="N: agentrl sft of N walkthroughs with each arm")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--no-op", action="store_true", help="the sft arms only")
    ap.add_argument("--one-arm", default=None, help=argparse.SUPPRESS)  # a child process: one arm as JSON
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_arm:
        print(json.dumps(sft_arm(args.sft, args.config, args.one_arm, args.out)))
        return
    from agentrl.models import native_bf16

    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_op:
        dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or native_bf16("cpu") else [])
        bench_op(args.shapes.split(","), dtypes, args.repeats)
    if args.sft:
        bench_sft(args.sft, args.config)


if __name__ == "__main__":
    main()
