"""How long a trajectory's context really grows, next to the KV plan's estimate.

Replays the episodes of an `agentrl eval` output (its recorded actions, on the real games, with
the eval's prompt settings: no model runs) and renders each trajectory's context as the sampler
saw it: the opening, then per step the reply and the next observation. Prints the openings, the
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
    """One row per episode of the eval: opening tokens, final tokens, steps."""
    from agentrl.env import find_games, prompt_messages
    from agentrl.env.alfworld import AlfworldEnv
    from agentrl.prompt import ChatRenderer, with_admissible

    renderer = ChatRenderer(tokenizer)
    messages = prompt_messages("alfworld", cfg.prompt)
    shown = (lambda s: with_admissible(s.observation, s.admissible)) if cfg.prompt.admissible else (lambda s: s.observation)
    games = {g.game_id: g for g in find_games("alfworld", summary["split"], None)}
    rows = []
    for line in (eval_dir / "episodes.jsonl").read_text().splitlines():
        e = json.loads(line)
        game = games[e["task_id"]]
        env = AlfworldEnv(game)
        state = env.reset()
        n = opening = len(renderer.initial(messages(game.task_type, shown(state), cfg.prompt.dir)))
        for reply, action in zip(e["responses"], e["actions"]):
            state = env.step(action)
            # the reply, its end-of-turn token, then the observation's turn up to the next assistant header
            n += len(renderer.encode(reply)) + len(renderer.end_of_turn_ids) + len(renderer.observation(shown(state), True))
        env.close()
        rows.append((opening, n, len(e["actions"])))
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
    from agentrl.sampling.kv import (
        TOKENS_PER_STEP,
        _round_up,
        expected_context_tokens,
        kv_bytes_per_token,
    )

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
    padded = len(a) * _round_up(int(final.max()), 128) * per_token
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
