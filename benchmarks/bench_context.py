"""How long a trajectory's context really grows, next to the KV plan's estimate.

Replays the episodes of an `agentrl eval` output (its recorded replies, on the real games, with
the eval's prompt settings: no model runs) through the rollout's own path, so each trajectory's
context is rendered as the sampler saw it: the opening, then per step the reply and the next
observation, up to the last reply (the last observation is never prefilled). Prints the openings, the
tokens a step adds (mean, p90, p95, max) and the final contexts, against what the sampler plans
with before a run (`kv.expected_context_tokens`: a typical opening plus `kv.TOKENS_PER_STEP` a
step), and what the KV store would hold for all the eval's rows at once: it pads every row to
the longest one (rounded up to its growth step).

Usage:
    python benchmarks/bench_context.py runs/bench-gpuws/eval/warmstart-it0/valid_seen
    python benchmarks/bench_context.py EVAL_DIR --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def replay(eval_dir: Path, summary: dict, cfg, tokenizer) -> np.ndarray:
    """One row per episode of the eval: opening tokens, final tokens, steps.

    The recorded replies are fed back through the rollout's own path (sft's ExpertSampler taking
    them verbatim, driving ModelPolicy in run_lockstep on the real games), so the contexts are
    rendered exactly as the sampler rendered them; only a reply's ids are its text re-tokenised
    (the sampler's own ids are not recorded). The final context is what the store held when the
    last reply was generated: the last observation is never prefilled."""
    from agentrl.env import env_factory, find_games, prompt_options
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    episodes = [json.loads(line) for line in (eval_dir / "episodes.jsonl").read_text().splitlines()]
    by_game = {g.game_id: g for g in find_games("alfworld", summary["split"], None)}
    replies: dict = {}
    for e in episodes:  # key (game, trajectory index): what the sampler is asked with
        replies.setdefault(e["task_id"], {})[e.get("trajectory", 0)] = e
    group_size = max(len(v) for v in replies.values())
    games = [by_game[g] for g in replies]
    sampler = ExpertSampler(tokenizer, {(g, i): tuple(e["responses"]) for g, v in replies.items() for i, e in v.items()},
                            None)
    policy = ModelPolicy(sampler, SamplingParams(0.0, 1.0, 10_000), seed=0, **prompt_options(cfg))
    rollout = run_lockstep(games, policy, max_steps=summary.get("max_steps") or 30, group_size=group_size,
                           fuzzy_threshold=cfg.env.fuzzy_threshold, make_env=env_factory(cfg.env.kind))
    rows, differ = [], 0
    for t in rollout.trajectories:
        e = replies[t.game.game_id].get(t.index)
        if e is None:  # fewer samples of this game than of others
            continue
        n = len(e["actions"])  # an episode cut short (context_full) replays with empty no-ops after: not counted
        differ += [s.command if s.valid else s.action for s in t.steps[:n]] != e["actions"]
        final = t.reply_starts[n - 1] + t.step_tokens[n - 1] if n else len(t.token_ids)
        rows.append((t.reply_starts[0] if t.reply_starts else len(t.token_ids), final, n))
    if differ:
        print(f"warning: {differ} of {len(rows)} replayed episodes took other actions than recorded "
              "(the games or the fuzzy matching changed since the eval)", file=sys.stderr)
    return np.array(rows, dtype=float)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("eval_dir", type=Path, help="an `agentrl eval --out` folder (episodes.jsonl, summary.json)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig

    from agentrl.config import load_config
    from agentrl.models import load_tokenizer, resolve_model
    from agentrl.rollout.plan import TOKENS_PER_STEP, expected_context_tokens
    from agentrl.sampling.compat import kv_bytes_per_token
    from agentrl.sampling.kv import round_up

    summary = json.loads((args.eval_dir / "summary.json").read_text())
    cfg = load_config(None)
    for k, v in (summary.get("prompt") or {}).items():  # the eval's prompt settings
        setattr(cfg.prompt, k, v)
    if cfg.prompt.history:
        raise SystemExit(f"{args.eval_dir}: prompt.history {cfg.prompt.history} keeps a window, not the whole episode; "
                         "this replay measures whole-episode contexts")
    tokenizer = load_tokenizer(summary.get("model") or "default", False)
    a = replay(args.eval_dir, summary, cfg, tokenizer)
    opening, final, steps = a[:, 0], a[:, 1], np.maximum(a[:, 2], 1)
    per_step = (final - opening) / steps
    max_steps = summary.get("max_steps") or 30
    estimate = expected_context_tokens(cfg, max_steps, tokenizer)
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(resolve_model(summary.get("model") or "default")), torch.float32)
    padded = len(a) * round_up(int(final.max()), 128) * per_token
    planned = len(a) * estimate * per_token
    q = lambda x, p: float(np.quantile(x, p))
    out = {
        "eval": str(args.eval_dir), "split": summary["split"], "episodes": len(a), "max_steps": max_steps,
        "opening": {"mean": float(opening.mean()), "max": float(opening.max())},
        "tokens_per_step": {"mean": float(per_step.mean()), "p90": q(per_step, .9), "p95": q(per_step, .95),
                            "max": float(per_step.max()), "planned": TOKENS_PER_STEP},
        "final": {"mean": float(final.mean()), "p95": q(final, .95), "max": float(final.max()),
                  "mean_of_full_length": float(final[a[:, 2] >= max_steps].mean()) if (a[:, 2] >= max_steps).any() else None},
        "estimate": estimate,
        "store_fp32_gb": {"planned": planned / (1 << 30), "padded_to_longest": padded / (1 << 30)},
    }
    print(f"{out['split']}: {len(a)} episodes of {args.eval_dir}, T_max {max_steps}")
    print(f"  opening       mean {opening.mean():6.0f}  max {opening.max():6.0f}  tokens")
    print(f"  per step      mean {per_step.mean():6.1f}  p90 {q(per_step, .9):5.1f}  p95 {q(per_step, .95):5.1f}  "
          f"max {per_step.max():5.1f}  (planned: {TOKENS_PER_STEP})")
    print(f"  final context mean {final.mean():6.0f}  p95 {q(final, .95):5.0f}  max {final.max():5.0f}  "
          f"(estimate before the run: {estimate}; longest / estimate {final.max() / estimate:.2f})")
    print(f"  KV store for all {len(a)} rows at once, fp32: planned {out['store_fp32_gb']['planned']:.2f} GB, "
          f"padded to the longest row {out['store_fp32_gb']['padded_to_longest']:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
