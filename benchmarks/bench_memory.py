"""The learner's memory: one forward + backward of a micro-batch, as `agentrl train` runs it, with
glibc's dynamic mmap threshold (Python's default) vs agentrl's fixed one (procmem.py), with and
without torch's transparent huge pages for large tensors (THP_MEM_ALLOC_ENABLE), with and without
gradient checkpointing, next to agentrl's estimate (train/memory.py). A script, not a test.

Each arm runs in a fresh process (peak RSS is per process): the default model with a LoRA on
every linear layer (r 32), `rows` x `tokens` random token ids, the loss's log-probs, backward.
Printed: peak RSS above the loaded model, the estimate, the time of the forward + backward, the
page faults and kernel CPU time of the two passes, and the ratios of each arm to the first.

Usage:
    python benchmarks/bench_memory.py                    # 2 rows x 2048 tokens (learning.yaml's micro-batch)
    python benchmarks/bench_memory.py --rows 1 --tokens 1024
    python benchmarks/bench_memory.py --arms fixed,fixed+thp   # some arms (each with checkpointing off and on)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

MODES = ("dynamic", "fixed", "reused", "fixed+thp", "dynamic+thp", "fixed-1m", "fixed-4m", "fixed-16m")
# malloc threshold (fixed: procmem's; fixed-4m: fixed at 4 MiB; reused: procmem's, the passes inside
# procmem.reused_heap()), +thp: torch's THP_MEM_ALLOC_ENABLE=1
THRESHOLDS = {"fixed-1m": 1 << 20, "fixed-4m": 4 << 20, "fixed-16m": 16 << 20}

CHILD = r"""
import contextlib, json, resource, sys, time, torch
mode, gc, rows, tokens = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
if mode.startswith("fixed") or mode == "reused":
    from agentrl.procmem import return_freed_memory, reused_heap
    assert return_freed_memory()
heap = reused_heap() if mode == "reused" else contextlib.nullcontext()
from agentrl.config import LearnerConfig
from agentrl.models import load_model
from agentrl.train.learner import LocalLearner
from agentrl.train.loss import token_logprobs
model, _ = load_model("default", "float32", "cpu", False)
learner = LocalLearner(model, LearnerConfig(lora_r=32, lora_alpha=64, gradient_checkpointing=gc))
learner.model.train()
ids = torch.randint(100, model.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
def hwm_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
base = rss_mib()
ru0 = resource.getrusage(resource.RUSAGE_SELF)
times = []
with heap:  # reused: the heap kept through both passes, trimmed at the end (as around an update)
    for _ in range(2):  # the second pass meets the heap the first one left
        t = time.perf_counter()
        token_logprobs(learner.model, ids, torch.ones_like(ids)).sum().backward()
        times.append(time.perf_counter() - t)
        learner.model.zero_grad(set_to_none=True)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"peak_mib": hwm_mib() - base, "after_mib": rss_mib() - base, "s": times,
                  "minflt": ru.ru_minflt - ru0.ru_minflt, "sys_s": ru.ru_stime - ru0.ru_stime}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--arms", default="dynamic,fixed", help=f"malloc modes, each with checkpointing off and on: {', '.join(MODES)}")
    args = ap.parse_args()
    modes = [m.strip() for m in args.arms.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        sys.exit(f"--arms: unknown mode {bad[0]!r} (one of {', '.join(MODES)})")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from transformers import AutoConfig

    from agentrl.models import resolve_model
    from agentrl.train import memory

    config = AutoConfig.from_pretrained(resolve_model("default"))
    lora = 16 * memory.lora_params(config, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    print(f"{args.rows} rows x {args.tokens} tokens, default model fp32, LoRA r32 on every linear layer; "
          f"torch {__import__('torch').__version__}, {os.cpu_count()} cores")
    print(f"| malloc | gradient checkpointing | peak RSS above the model (MiB) | RSS left after (MiB) | "
          f"agentrl's estimate (MiB) | forward+backward (s, 1st / 2nd) | page faults | kernel CPU (s) | peak vs first arm | time vs first arm |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    first = None
    env = os.environ.copy()
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env["AGENTRL_MALLOC"] = ""
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    for gc, mode in itertools.product((False, True), modes):
        child_env = {**env, "THP_MEM_ALLOC_ENABLE": "1"} if mode.endswith("+thp") else env
        if mode in THRESHOLDS:
            child_env = {**env, "MALLOC_MMAP_THRESHOLD_": str(THRESHOLDS[mode])}
        p = subprocess.run([sys.executable, "-c", CHILD, mode, "1" if gc else "0", str(args.rows), str(args.tokens)],
                           capture_output=True, text=True, env=child_env)
        if p.returncode != 0:
            sys.exit(p.stderr[-2000:])
        r = json.loads(p.stdout.strip().splitlines()[-1])
        est = (args.rows * args.tokens * memory.activation_bytes_per_token(config, 4, gc)
               + args.rows * min(512, args.tokens) * config.vocab_size * 4 * memory.LOGIT_COPIES + lora) / (1 << 20)
        first = first or r
        print(f"| {mode} | {'on' if gc else 'off'} | {r['peak_mib']:.0f} | {r['after_mib']:.0f} | {est:.0f} | "
              f"{r['s'][0]:.1f} / {r['s'][1]:.1f} | {r['minflt']:,} | {r['sys_s']:.1f} | {r['peak_mib'] / first['peak_mib']:.2f}x | "
              f"{sum(r['s']) / sum(first['s']):.2f}x |", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
