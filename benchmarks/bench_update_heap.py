"""One GRPO update on a CPU with the update's freed tensors reused from glibc's heap
(`learner.heap: auto`, where the estimate fits: procmem.reused_heap) against agentrl's fixed mmap
threshold (`learner.heap: fixed`: every freed block unmapped, the next faulted in afresh). A
script, not a test.

Workload: real trajectories from `agentrl rollout` (trajectories.jsonl) sampled by the adapter
given; the informative groups (rewards not all equal), GRPO advantages; the learner of
configs/grpo-full.yaml (LoRA r 32 continued from the adapter, lr 1e-4, micro-batch 2, minibatches
4, clip 0.2, KL beta 50 to the adapter). Each arm runs in a fresh process (peak RSS and page faults
are per process), the arms alternated over `--repeats`. Printed per run: the update's seconds, its
user and kernel CPU, page faults, peak RSS, whether the heap was reused; then the median ratio,
and the largest difference of the updated LoRA weights between the arms (the heap changes where
memory comes from, not a number: 0 expected).

Usage: python benchmarks/bench_update_heap.py --buffer ROLLOUT_DIR --adapter WS [--dtype float32|bfloat16]
           [--repeats 2] [--groups 0 (all informative)]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
import torch
from safetensors.torch import save_file
from agentrl.procmem import return_freed_memory
return_freed_memory()  # as the CLI does at start
from agentrl.config import LearnerConfig
from agentrl.models import load_model
from agentrl.train import learner as learner_mod
from agentrl.train.advantage import group_advantages
from agentrl.train.offpolicy import load_buffer
heap, buffer, adapter, dtype, groups, out = sys.argv[1:7]
gs = [g for g in load_buffer(buffer) if len({t.reward for t in g.trajectories}) > 1]
gs = gs[: int(groups)] if int(groups) else gs
batch = [(t, float(a)) for g in gs for t, a in zip(g.trajectories, group_advantages([t.reward for t in g.trajectories]))]
model, _ = load_model("default", dtype, "cpu", False)
cfg = LearnerConfig(lora_r=32, lora_alpha=64, lr=1e-4, micro_batch=2, minibatches=4, clip=0.2, kl_coef=50.0, heap=heap)
learner = learner_mod.LocalLearner(model, cfg, init_adapter=adapter)
reused = []
plain = learner.heap
learner.heap = lambda plan: (reused.append(type(ctx := plain(plan)).__name__ != "nullcontext"), ctx)[1]
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
stats = learner.update(batch)
s = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
save_file({k: v.detach().float().contiguous() for k, v in learner.model.named_parameters() if v.requires_grad}, out)
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / (1 << 20)
print(json.dumps({"s": s, "user_s": ru.ru_utime - ru0.ru_utime, "sys_s": ru.ru_stime - ru0.ru_stime,
                  "faults": ru.ru_minflt - ru0.ru_minflt, "peak_gb": hwm, "reused": any(reused),
                  "steps": stats.optimizer_steps, "trajectories": len(batch),
                  "tokens": sum(len(t.token_ids) for t, _ in batch)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffer", required=True, help="an `agentrl rollout` output (its trajectories.jsonl)")
    ap.add_argument("--adapter", required=True, help="the adapter that sampled the buffer")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--groups", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"dtype {a.dtype}; {time.strftime('%Y-%m-%d %H:%M')}")
    runs: dict[str, list[dict]] = {"auto": [], "fixed": []}
    weights: dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="bench-heap-")
    for r in range(a.repeats):
        for heap in (("fixed", "auto") if r % 2 == 0 else ("auto", "fixed")):
            out = os.path.join(tmp, f"{heap}-{r}.safetensors")
            p = subprocess.run([sys.executable, "-c", CHILD, heap, a.buffer, a.adapter, a.dtype, str(a.groups), out],
                               capture_output=True, text=True, env=env)
            if p.returncode != 0:
                sys.exit(p.stderr[-3000:])
            row = json.loads(p.stdout.strip().splitlines()[-1])
            runs[heap].append(row)
            weights[heap] = out
            print(f"  heap {heap:5s} {row['s']:7.1f} s  user {row['user_s']:6.1f} s  kernel {row['sys_s']:6.1f} s  "
                  f"faults {row['faults']:>11,}  peak {row['peak_gb']:5.2f} GB  reused {row['reused']}  "
                  f"({row['trajectories']} trajectories, {row['tokens']} tokens, {row['steps']} steps)", flush=True)
    mf, ma = (statistics.median(r["s"] for r in runs[h]) for h in ("fixed", "auto"))
    wf, wa = load_file(weights["fixed"]), load_file(weights["auto"])
    diff = max(float((wf[k] - wa[k]).abs().max()) for k in wf)
    print(f"update: fixed {mf:.1f} s, auto {ma:.1f} s: {mf / ma:.2f}x (median of {a.repeats}); peak "
          f"{statistics.median(r['peak_gb'] for r in runs['fixed']):.2f} -> {statistics.median(r['peak_gb'] for r in runs['auto']):.2f} GB; "
          f"largest weight difference between the arms {diff:.2e}")


if __name__ == "__main__":
    main()
