"""The learn step's forward + backward with the vocabulary projection at the action tokens only
(`sequence_logprobs(..., masks=)`, what the learner runs) against at every position (what it ran
before), side by side in one process, arms alternated. A script, not a test.

Workload: the default model in fp32 with the learner's LoRA (r 32 on every linear layer), one
packed micro-batch of `--rows` sequences of `--tokens` token ids, shaped as a trajectory: a
prompt of `--prompt` tokens, then turns of an observation of `--observation` tokens and a reply
of `--reply` tokens (the action tokens). Printed: seconds per forward + backward of the summed
action-token log-probs for each arm (median of `--repeats`), the ratio, and the largest
difference of the log-probs and of the gradient between the arms.

Usage: python benchmarks/bench_learn_step.py [--rows 2] [--tokens 1536] [--prompt 850]
           [--observation 60] [--reply 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--prompt", type=int, default=850)
    ap.add_argument("--observation", type=int, default=60)
    ap.add_argument("--reply", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import torch

    from agentrl.config import LearnerConfig
    from agentrl.models import load_model
    from agentrl.train.learner import LocalLearner
    from agentrl.train.packing import pack, sequence_logprobs

    model, _ = load_model("default", "float32", "cpu", False)
    learner = LocalLearner(model, LearnerConfig(lora_r=32, lora_alpha=64))
    learner.model.train()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, model.config.vocab_size, (a.tokens,), generator=g).tolist() for _ in range(a.rows)]
    turn = [0] * a.observation + [1] * a.reply
    mask = ([0] * a.prompt + turn * a.tokens)[: a.tokens]
    masks = [mask] * a.rows
    batch = pack(seqs, [[i] for i in range(a.rows)], "cpu", packed=True)
    weight = torch.tensor(masks, dtype=torch.float32)

    def run(arm_masks):
        learner.model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logp = sequence_logprobs(learner.model, batch, masks=arm_masks)
        (logp * weight).sum().backward()
        s = time.perf_counter() - t
        return s, logp.detach(), torch.cat([p.grad.flatten() for p in learner.params])

    times = {"every position": [], "action tokens": []}
    out = {}
    run(masks)  # warm-up: the first pass pays allocations
    for _ in range(a.repeats):
        for name, m in (("every position", None), ("action tokens", masks)):
            s, logp, grad = run(m)
            times[name].append(s)
            out[name] = (logp * weight, grad)
    (lp_a, g_a), (lp_b, g_b) = out["every position"], out["action tokens"]
    full, picked = (statistics.median(times[k]) for k in times)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{a.rows} x {a.tokens} tokens, {sum(mask)} action tokens a row ({100 * sum(mask) / a.tokens:.0f}%)")
    print(f"forward + backward, median of {a.repeats}: every position {full:.2f} s, action tokens only "
          f"{picked:.2f} s: {full / picked:.2f}x")
    print(f"largest difference: log-probs {float((lp_a - lp_b).abs().max()):.2e}, gradient "
          f"{float((g_a - g_b).abs().max()):.2e} (largest gradient entry {float(g_a.abs().max()):.2e})")


if __name__ == "__main__":
    main()
