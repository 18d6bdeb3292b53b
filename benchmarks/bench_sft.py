"""How fast the warm start's optimizer steps run: padded vs packed micro-batches, side by side on
the same examples and steps (a script, not a test).

The examples are the config's walkthroughs (default configs/learning.yaml: the 120-game set,
replayed or read from the sft-data cache), cut to the first --games games; the steps are the
recipe's (sft.token_budget buckets, sft.batch_games per step; --batch-games overrides it to
show a step that holds several games). Each arm trains a fresh LoRA on a fresh copy of the
model for one epoch of those steps (the arms take turns, step by step: a shared CPU slows them alike) and reports examples/s, the tokens it computed per real token
(padding), micro-batches, and its ratio to the first arm. Arms (learner settings):

    padded-bucket  tokens_per_microbatch = sft.token_budget, packing off (the path before packing)
    packed-bucket  the same budget, packed
    padded-auto    tokens_per_microbatch auto (from free memory), one example per row, padded
    packed-auto    tokens_per_microbatch auto (from free memory), packed
    packed-auto-bf16  the same under learner.autocast bf16 (fp32 weights; on a CPU with bf16 matmuls)

Each arm also prints its epoch's train NLL (the arms' agreement).

Usage:
    python benchmarks/bench_sft.py                                  # 40 games, the default model
    python benchmarks/bench_sft.py --games 40 --batch-games 1,8
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import random
import sys
import time

import torch

from agentrl.config import load_config
from agentrl.models import cache_root, load_model
from agentrl.train.memory import tokens_per_microbatch
from agentrl.train.sft import (example_micro_batches, expert_dataset, micro_batches, nll_loss, optimizer_steps,
                               select_games, sft_learner, sft_prompt)

ARMS = {"padded-bucket": ("budget", False, "auto"), "packed-bucket": ("budget", True, "auto"),
        "padded-auto": ("auto", False, "auto"), "packed-auto": ("auto", True, "auto"),
        "packed-auto-bf16": ("auto", True, "bf16")}


class Arm:
    """One arm's learner (a fresh LoRA on a fresh copy of the model) and its running totals."""

    def __init__(self, cfg, base, tokens, packing: bool, autocast: str):
        self.cfg = copy.deepcopy(cfg)
        self.cfg.learner = dataclasses.replace(cfg.learner, tokens_per_microbatch=tokens, packing=packing, autocast=autocast)
        self.learner = sft_learner(self.cfg, copy.deepcopy(base))
        self.budget = tokens_per_microbatch(tokens, self.learner.model, self.learner.device, False)
        self.seconds = 0.0
        self.computed = self.real = self.parts = 0
        self.nll_sum = 0.0  # the epoch's train NLL (summed over reply tokens): the arms' agreement
        self.reply_tokens = 0

    def step(self, step_examples) -> None:
        mbs = example_micro_batches(self.learner, step_examples)
        for rows in mbs:
            fill = [sum(len(step_examples[i].token_ids) for i in row) for row in rows]
            self.computed += len(rows) * max(fill)  # a micro-batch's tensor: rows x its fullest row
            self.real += sum(fill)
        self.parts += len(mbs)
        n_tokens = sum(e.reply_tokens for e in step_examples)
        t0 = time.perf_counter()
        result = self.learner.step(mbs, nll_loss(self.learner, step_examples, n_tokens), self.cfg.sft.grad_clip)
        self.seconds += time.perf_counter() - t0
        self.nll_sum += sum(result.values)
        self.reply_tokens += n_tokens


def run_arms(cfg, base, examples, batch_games: int, arms: list[str]) -> dict[str, Arm]:
    """One epoch of the recipe's steps per arm, the arms taking turns step by step (a shared,
    noisy CPU slows them alike)."""
    out = {a: Arm(cfg, base, cfg.sft.token_budget if ARMS[a][0] == "budget" else "auto", *ARMS[a][1:]) for a in arms}
    order = micro_batches(examples, cfg.sft.token_budget)
    random.Random(cfg.seed).shuffle(order)
    for pending in optimizer_steps(order, batch_games):
        for arm in out.values():
            arm.step([e for b in pending for e in b])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/learning.yaml")
    ap.add_argument("--games", type=int, default=40, help="walkthroughs trained on (the first of the config's set)")
    ap.add_argument("--batch-games", default=None, help="games per optimizer step, comma-separated (default: the config's)")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    cfg = sft_prompt(load_config(args.config))
    model, tokenizer = load_model(cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)
    games = select_games(cfg, cfg.sft.split, cfg.sft.games)
    data = expert_dataset(cfg, games, tokenizer, cache_dir=cache_root() / "sft-data")
    keep = {g.game_id for g in games[: args.games]}
    examples = [e for e in data.examples if e.game_id in keep]
    tokens = sum(len(e.token_ids) for e in examples)
    print(f"{len(examples)} examples from {len(keep)} games ({tokens} tokens, mean {tokens / len(examples):.0f}, "
          f"longest {max(len(e.token_ids) for e in examples)}); model {cfg.model.name} on {cfg.model.device}; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{'' if data.cached else ' (replayed)'}")
    batch_games = [int(b) for b in args.batch_games.split(",")] if args.batch_games else [cfg.sft.batch_games]
    for bg in batch_games:
        print(f"\nsft.batch_games {bg}, sft.token_budget {cfg.sft.token_budget}:")
        print(f"  {'arm':14} {'steps':>5} {'micro':>5} {'budget':>7} {'s':>7} {'ex/s':>6} {'tok/s':>7} {'computed/real':>13} {'train NLL':>9} {'x first':>7}")
        arms = run_arms(cfg, model, examples, bg, args.arms.split(","))
        first = None
        for name, r in arms.items():
            rate = len(examples) / r.seconds
            first = first or rate
            print(f"  {name:14} {len(optimizer_steps(micro_batches(examples, cfg.sft.token_budget), bg)):5} {r.parts:5} "
                  f"{r.budget:>7} {r.seconds:7.1f} {rate:6.2f} {r.real / r.seconds:7.0f} {r.computed / r.real:13.3f} "
                  f"{r.nll_sum / r.reply_tokens:9.4f} {rate / first:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
