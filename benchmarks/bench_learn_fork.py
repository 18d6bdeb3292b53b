"""The learner's shared prefixes (`learner.share_prefixes`, `packing.fork`) against forwarding every
sequence whole, side by side in one process, arms alternated. A script, not a test.

Workload: the default model in fp32 with the learner's LoRA (r 32 on every linear layer), one
micro-batch of `--rows` trajectories of one group: a shared first prompt of `--prompt` tokens (514
on average with `make train`'s warm start at T_max 30: the common opening of a group's G rows), then
each row's own turns (an observation of `--observation` tokens, a reply of `--reply` action tokens)
up to a length drawn uniformly in [0.6, 1.4] x `--tokens` (1,449 on average there). The plain arm
is what the learner ran before: one row per sequence (`learner.micro_batch` rows, padded to the
widest); the fork arm runs the prompt once and the suffixes against it. Printed: seconds per forward
+ backward of the summed action-token log-probs (median of `--repeats`), the ratio, the tokens each
arm computes, the peak RSS after the fork arm alone and after both, and the largest difference of the log-probs and of the gradient between the arms.

Usage: python benchmarks/bench_learn_fork.py [--rows 4] [--tokens 1450] [--prompt 514]
           [--observation 60] [--reply 10] [--repeats 3] [--packed]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1450)
    ap.add_argument("--prompt", type=int, default=514)
    ap.add_argument("--observation", type=int, default=60)
    ap.add_argument("--reply", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packed", action="store_true", help="the plain arm packs its rows (the token-budget path)")
    a = ap.parse_args()

    import torch

    from agentrl.config import LearnerConfig
    from agentrl.models import load_model
    from agentrl.train.learner import LocalLearner
    from agentrl.train.packing import Forked, fork, pack, sequence_logprobs, token_micro_batches

    model, _ = load_model("default", "float32", "cpu", False)
    learner = LocalLearner(model, LearnerConfig(lora_r=32, lora_alpha=64))
    learner.model.train()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (a.prompt,), generator=g).tolist()
    seqs, masks = [], []
    for _ in range(a.rows):
        n = int(a.tokens * (0.6 + 0.8 * torch.rand(1, generator=g).item()))
        seqs.append(prompt + torch.randint(100, vocab, (n - a.prompt,), generator=g).tolist())
        turn = [0] * a.observation + [1] * a.reply
        masks.append(([0] * a.prompt + turn * n)[:n])
    rows = token_micro_batches([len(s) for s in seqs], 10**9)[0] if a.packed else [[i] for i in range(a.rows)]
    order = [i for row in rows for i in row]
    m = [masks[i] for i in order]
    plain = pack(seqs, rows, "cpu", packed=True)
    forked = fork(seqs, rows, m, "cpu", packed=a.packed)
    assert isinstance(forked, Forked), "no fork pays here"
    plain_tokens = plain.input_ids.numel()
    fork_tokens = sum(f.shared + f.suffixes.numel() for f in forked.forks) + (
        forked.rest.input_ids.numel() if forked.rest is not None else 0)
    width = max(len(x) for x in m)
    weight = torch.zeros((len(m), width))
    for k, x in enumerate(m):
        weight[k, : len(x)] = torch.tensor(x, dtype=torch.float32)

    def run(batch):
        learner.model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logp = sequence_logprobs(learner.model, batch, masks=m)
        (logp * weight).sum().backward()
        s = time.perf_counter() - t
        return s, logp.detach(), torch.cat([p.grad.flatten() for p in learner.params])

    times = {"plain": [], "fork": []}
    out = {}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    run(forked)  # warm-up: the first pass pays allocations; the peak so far is the fork arm's own
    fork_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    for _ in range(a.repeats):
        for name, batch in (("plain", plain), ("fork", forked)):
            s, logp, grad = run(batch)
            times[name].append(s)
            out[name] = (logp, grad)
    (lp_a, g_a), (lp_b, g_b) = out["plain"], out["fork"]
    t_plain, t_fork = (statistics.median(times[k]) for k in times)
    lengths = [len(s) for s in seqs]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {a.rows} rows of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f}), a {a.prompt}-token shared prompt, "
          f"plain arm {'packed' if a.packed else 'one row per sequence'}")
    print(f"tokens computed: plain {plain_tokens:,}, fork {fork_tokens:,} ({fork_tokens / plain_tokens:.2f})")
    print(f"forward + backward, median of {a.repeats}: plain {t_plain:.2f} s, fork {t_fork:.2f} s: "
          f"{t_plain / t_fork:.2f}x")
    both_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS: {base_rss:.2f} GB loaded, {fork_rss:.2f} GB after the fork arm alone, {both_rss:.2f} GB after "
          f"both (higher: the plain arm's peak)")
    print(f"largest difference: log-probs {float((lp_a - lp_b).abs().max()):.2e}, gradient "
          f"{float((g_a - g_b).abs().max()):.2e} (largest gradient entry {float(g_a.abs().max()):.2e})")


if __name__ == "__main__":
    main()
