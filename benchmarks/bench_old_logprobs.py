"""One PPO-style update (`learner.epochs` x `learner.minibatches` > 1) with p_old recomputed by the
learner's no-grad pre-pass (`learner.old_logprobs: learner`, the default) against p_old taken from
the sampler's own log-probs (`sampler`: no pre-pass), side by side in one process, arms
alternated. A script, not a test.

Workload: real trajectories from `agentrl rollout` (trajectories.jsonl) sampled by the adapter
given (the learner starts from it, so the sampler's log-probs are the policy's at the start of the
update, as in `agentrl train`); the first `--groups` informative groups (rewards not all equal),
GRPO advantages; the recipe of configs/grpo-full.yaml (LoRA r 32, lr 1e-4, micro-batch 2,
minibatches 4, clip 0.2, KL beta 50 to the adapter), fp32 on the CPU. Printed per arm: the
update's seconds, optimizer steps, logprob_gap, first-step loss; then the ratio, and the largest
difference of the updated LoRA weights between the arms against the largest weight change.

Usage: python benchmarks/bench_old_logprobs.py --buffer ROLLOUT_DIR --adapter WS [--groups 1]
           [--minibatches 4] [--kl-coef 50] [--repeats 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffer", required=True, help="an `agentrl rollout` output (its trajectories.jsonl)")
    ap.add_argument("--adapter", required=True, help="the adapter that sampled the buffer")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--kl-coef", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()

    import torch

    from agentrl.config import LearnerConfig
    from agentrl.models import load_model
    from agentrl.train.advantage import group_advantages
    from agentrl.train.learner import LocalLearner
    from agentrl.train.offpolicy import load_buffer

    groups = [g for g in load_buffer(a.buffer) if len({t.reward for t in g.trajectories}) > 1][: a.groups]
    batch = [(t, float(adv)) for g in groups
             for t, adv in zip(g.trajectories, group_advantages([t.reward for t in g.trajectories]))]
    tokens = sum(len(t.token_ids) for t, _ in batch)
    print(f"{len(groups)} informative group(s), {len(batch)} trajectories, {tokens} tokens, "
          f"{sum(sum(t.action_mask) for t, _ in batch)} action tokens; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}")

    def arm(source: str):
        model, _ = load_model("default", "float32", "cpu", False)
        cfg = LearnerConfig(lora_r=32, lora_alpha=64, lr=1e-4, micro_batch=2, minibatches=a.minibatches,
                            clip=0.2, kl_coef=a.kl_coef, old_logprobs=source)
        learner = LocalLearner(model, cfg, init_adapter=a.adapter)
        start = [p.detach().clone() for p in learner.params]
        t = time.perf_counter()
        stats = learner.update(batch)
        s = time.perf_counter() - t
        after = [p.detach().clone() for p in learner.params]
        del learner, model
        gc.collect()
        return s, stats, start, after

    times: dict[str, list[float]] = {"learner": [], "sampler": []}
    last = {}
    for r in range(a.repeats):
        for source in (("learner", "sampler") if r % 2 == 0 else ("sampler", "learner")):
            s, stats, start, after = arm(source)
            times[source].append(s)
            last[source] = (stats, start, after)
            print(f"  {source:8s} {s:7.1f} s  steps {stats.optimizer_steps}  gap {stats.logprob_gap:.2e}  "
                  f"loss {stats.loss:.6f}  clip {stats.clip_fraction:.4f}  KL {stats.kl:.5f}", flush=True)
    ml, ms = statistics.median(times["learner"]), statistics.median(times["sampler"])
    (_, start, w_l), (_, _, w_s) = last["learner"], last["sampler"]
    moved = max(float((b - s0).abs().max()) for s0, b in zip(start, w_l))
    diff = max(float((x - y).abs().max()) for x, y in zip(w_l, w_s))
    print(f"update: learner pre-pass {ml:.1f} s, sampler p_old {ms:.1f} s: {ml / ms:.2f}x "
          f"(median of {a.repeats}); largest weight difference between the arms {diff:.2e} "
          f"(largest change of a weight in the update {moved:.2e})")


if __name__ == "__main__":
    main()
