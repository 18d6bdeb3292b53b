"""The vocabulary projection of strided hidden states, with and without `models.contiguous_head`
(a script, not a test).

transformers projects `hidden[:, -k:, :]` (`logits_to_keep`: every prefill forward's last
position, and the learner's forward that only wants hidden states), a strided view of
[rows, positions, hidden]. torch's CPU matmul then takes the bmm path, which expands the head's
weight over the rows and copies it ([rows, hidden, vocab] per call). `contiguous_head` hands the
head a contiguous copy of the rows' states instead.

1. The op: `F.linear(hidden[:, -1:, :], head)` against the same input made contiguous, for the
   default model's head (49,152 x 576), `--rows` rows, fp32 and bf16 (bf16 only where the CPU has
   bf16 matmuls, or with --bf16), `--calls` calls each; the ratio, and the largest logit difference.
2. `--eval N,STEPS`: `agentrl eval` of the first N valid_seen games at T_max STEPS with
   `--config` (default configs/default.yaml) and `--adapter`, once without the hook and once with it,
   one after the other in this process: wall seconds, the ratio, and whether every episode's
   actions are the same.

Usage:
    python benchmarks/bench_head.py                         # the op, 6 / 24 / 48 rows
    python benchmarks/bench_head.py --eval 24,10 --adapter ~/.cache/agentrl/warmstart/default
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F


def per_call_ms(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1000


def bench_op(rows: list[int], calls: int, dtypes: list[torch.dtype], positions: int = 105) -> None:
    print("| dtype | rows | strided view ms | contiguous ms | ratio | largest logit difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in dtypes:
        torch.manual_seed(0)
        head = torch.randn(49152, 576, dtype=dtype) * 0.02
        for n in rows:
            view = torch.randn(n, positions, 576, dtype=dtype)[:, -1:, :]
            packed = view.contiguous()
            strided = per_call_ms(lambda: F.linear(view, head), calls)
            contiguous = per_call_ms(lambda: F.linear(packed, head), calls)
            diff = (F.linear(view, head).float() - F.linear(packed, head).float()).abs().max().item()
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {n} | {strided:.1f} | {contiguous:.1f} | {strided / contiguous:.1f}x | {diff:.1e} |")


def bench_eval(spec: str, config: str, adapter: str | None) -> None:
    import agentrl.models as models
    import agentrl.sampling.hf as hf
    import agentrl.train.learner as learner
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval

    limit, steps = (int(x) for x in spec.split(","))
    overrides = {"eval.limit": limit, "eval.max_steps": steps, "model.adapter": adapter}
    real = models.contiguous_head
    results = {}
    for arm in ("without", "with"):
        hook = real if arm == "with" else (lambda model: model)
        models.contiguous_head = hf.contiguous_head = learner.contiguous_head = hook
        cfg = load_config(config, overrides)
        start = time.perf_counter()
        result = run_eval(cfg)
        wall = time.perf_counter() - start
        actions = [[s.action for s in t.steps] for t in result.trajectories]
        results[arm] = (wall, actions, sum(t.won for t in result.trajectories))
        print(f"{arm} the hook: {wall:.1f} s, won {results[arm][2]}/{limit}")
    models.contiguous_head = hf.contiguous_head = learner.contiguous_head = real
    (w0, a0, _), (w1, a1, _) = results["without"], results["with"]
    same = sum(x == y for x, y in zip(a0, a1))
    print(f"eval of {limit} games x T_max {steps} ({config}, dtype {cfg.model.dtype}): {w0:.1f} -> {w1:.1f} s "
          f"({w0 / w1:.2f}x); episodes with the same actions: {same}/{limit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="6,24,48")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--bf16", action="store_true", help="bf16 even where the CPU emulates it")
    ap.add_argument("--eval", default=None, help="N,STEPS: an eval of N valid_seen games at T_max STEPS, without and with the hook")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--adapter", default=None)
    args = ap.parse_args()
    from agentrl.models import native_bf16

    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or native_bf16("cpu") else [])
    bench_op([int(r) for r in args.rows.split(",")], args.calls, dtypes)
    if args.eval:
        bench_eval(args.eval, args.config, args.adapter)


if __name__ == "__main__":
    main()
