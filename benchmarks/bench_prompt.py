"""The field's prompt options side by side: a warm start per option, at equal optimizer steps, each
evaluated greedily on the same held-out games (a script, not a test).

Arms (prompt settings the warm start is taught and evaluated with; everything else from
`--config`, default configs/learning.yaml):
  none               the whole episode, no command list (agentrl's default)
  history2           the task and the last 2 turns (`prompt.history: 2`; verl-agent's history_length 2)
  admissible         the whole episode, the admissible commands after every observation
  admissible-history2  both (verl-agent's ALFWorld prompt)

Per arm: `agentrl sft --config W/<arm>.yaml` (the config plus the arm's prompt section), then
`agentrl eval` of it on each split. What is held equal (`--equal`):
  tokens  (default) training compute: the first arm trains the config's games; every other arm
          trains the first N games of the same round-robin order whose replayed SFT tokens
          come closest to the first arm's (a windowed prompt repeats the opening at every step,
          so it trains fewer games for the same compute)
  steps   optimizer steps: every arm trains the config's games (under `prompt.history` a game's
          steps are its examples, agentrl sft's `per_game`, so the step count is the same);
          what differs is the tokens each step trains (4.6x with `prompt.history: 2`)
Then a table: SFT games, tokens and minutes, success with its 95% interval, valid-action rate,
eval minutes, and each arm paired with the first on the same games (exact McNemar).

Every command is skipped when its output exists: run it again to continue.

Usage:
    python benchmarks/bench_prompt.py --work runs/bench-prompt                          # learning.yaml's recipe, all games
    python benchmarks/bench_prompt.py --work W --arms none,history2 --equal steps       # equal optimizer steps
    python benchmarks/bench_prompt.py --work W --games 24 --epochs 1 --eval-limit 24    # a smaller reading
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_learning import machine, outcomes, run, summary  # noqa: E402

ARMS = {
    "none": {},
    "history2": {"history": 2},
    "admissible": {"admissible": True},
    "admissible-history2": {"admissible": True, "history": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-prompt"))
    ap.add_argument("--config", default="configs/learning.yaml")
    ap.add_argument("--arms", default="none,history2,admissible-history2", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--splits", default="valid_seen", help="held-out splits to evaluate each warm start on")
    ap.add_argument("--games", type=int, default=None, help="walkthroughs (default: the config's sft.games)")
    ap.add_argument("--epochs", type=int, default=None, help="SFT epochs (default: the config's)")
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out games per split (default: all)")
    ap.add_argument("--equal", choices=("tokens", "steps"), default="tokens",
                    help="hold SFT tokens (training compute) or optimizer steps equal across arms")
    ap.add_argument("--env-workers", default="auto")
    args = ap.parse_args()
    from agentrl.stats import paired, wilson

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        sys.exit(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    base = yaml.safe_load(Path(args.config).read_text()) or {}
    t_max = (base.get("eval") or {}).get("max_steps") or (base.get("env") or {}).get("max_steps", 30)
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    log = w / "commands.log"
    print(f"machine: {machine()}; work dir {w}; config {args.config}; arms {', '.join(arms)}")
    t0 = time.perf_counter()
    rows = []
    for arm in arms:
        cfg = json.loads(json.dumps(base))
        cfg["prompt"] = {**(cfg.get("prompt") or {}), **ARMS[arm]}
        if args.games:
            cfg.setdefault("sft", {})["games"] = args.games
        if args.epochs:
            cfg.setdefault("sft", {})["epochs"] = args.epochs
        arm_cfg = w / f"{arm}.yaml"
        arm_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
        if args.equal == "tokens" and arm != arms[0]:
            cfg.setdefault("sft", {})["games"] = games_for_tokens(arm_cfg, first_tokens)
            arm_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
        ws = w / arm / "warmstart"
        run(["sft", "--out", str(ws), "--reuse", "--force", "--config", str(arm_cfg), "--env-workers", args.env_workers],
            ws / "agentrl.json", log)
        record = json.loads((ws / "agentrl.json").read_text())
        dataset = next(json.loads(x) for x in (ws / "sft_metrics.jsonl").read_text().splitlines() if '"dataset"' in x)
        if arm == arms[0]:
            first_tokens = dataset["tokens"]
        for split in splits:
            out = w / arm / "eval" / split
            if not (out / "summary.json").is_file():
                t = time.perf_counter()
                run(["eval", "--split", split, "--max-steps", str(t_max), "--limit", str(args.eval_limit or 100_000),
                     "--adapter", str(ws), "--out", str(out), "--config", str(arm_cfg), "--env-workers", args.env_workers],
                    out / "summary.json", log)
                (out / "bench_wall_s.txt").write_text(f"{time.perf_counter() - t:.1f}\n")
            o = summary(out)
            lo, hi = wilson(o["won"], o["episodes"]) or (0.0, 0.0)
            wall = out / "bench_wall_s.txt"
            rows.append({"arm": arm, "split": split, "won": o["won"], "games": o["episodes"], "success": o["success_rate"],
                         "lo": lo, "hi": hi, "valid": o.get("valid_action_rate") or 0.0,
                         "eval_min": float(wall.read_text()) / 60 if wall.is_file() else None,
                         "sft_tokens": dataset["tokens"], "examples": dataset["examples"], "games_trained": dataset["games"],
                         "steps": record["sft"]["optimizer_steps"], "sft_min": record.get("minutes"), "dir": out})
    lines = [f"# Prompt options side by side ({time.strftime('%Y-%m-%d')}, {machine()}, {args.config})", "",
             f"Held equal: {'SFT tokens (training compute)' if args.equal == 'tokens' else 'optimizer steps'}.", "",
             "| prompt | SFT games | SFT examples | SFT tokens (an epoch) | optimizer steps | SFT min | split | won | success [95% CI] | valid actions | eval min | vs first arm, paired |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | --- |"]
    first = {r["split"]: r for r in rows if r["arm"] == arms[0]}
    for r in rows:
        vs = ""
        if r["arm"] != arms[0] and r["split"] in first:
            p = paired(outcomes(first[r["split"]]["dir"]), outcomes(r["dir"]))
            vs = (f"{p['difference_points']:+.1f} points ({len(p['won_only_by_b'])} won / {len(p['won_only_by_a'])} lost), "
                  f"p = {p['mcnemar_p']:.2g}")
        lines.append(f"| {r['arm']} | {r['games_trained']} | {r['examples']} | {r['sft_tokens']:,} | {r['steps']} | "
                     f"{r['sft_min'] if r['sft_min'] is not None else '-'} | {r['split']} | {r['won']}/{r['games']} | "
                     f"{100 * r['success']:.1f}% [{100 * r['lo']:.1f}, {100 * r['hi']:.1f}] | {100 * r['valid']:.0f}% | "
                     f"{'-' if r['eval_min'] is None else round(r['eval_min'], 1)} | {vs} |")
    (w / "prompt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nall done in {(time.perf_counter() - t0) / 60:.1f} min; {w / 'prompt.md'}")


def games_for_tokens(arm_cfg: Path, target: int) -> int:
    """The N whose first N games (sft's round-robin order, so every N is a prefix of the next)
    replay, with this arm's prompt, to the number of SFT tokens closest to `target`. Replays the
    config's games once through the real env, into sft's cache (so the arm's sft reuses nothing
    it should not: its own, smaller game list has its own key)."""
    from agentrl.config import load_config
    from agentrl.env import open_envs
    from agentrl.models import cache_root, load_tokenizer
    from agentrl.train.sft import expert_dataset, select_games, sft_prompt

    cfg = sft_prompt(load_config(arm_cfg))
    games = select_games(cfg, cfg.sft.split, cfg.sft.games)
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    envs = open_envs(cfg)
    try:
        data = expert_dataset(cfg, games, tokenizer, envs, cache_root() / "sft-data")
    finally:
        if envs is not None:
            envs.shutdown()
    per_game: dict[str, int] = {}
    for e in data.examples:
        per_game[e.game_id] = per_game.get(e.game_id, 0) + len(e.token_ids)
    best, total = (1, None), 0
    for n, g in enumerate(games, 1):
        total += per_game.get(g.game_id, 0)
        if best[1] is None or abs(total - target) < best[1]:
            best = (n, abs(total - target))
    print(f"  equal tokens: {best[0]} of {len(games)} games replay to ~{target:,} SFT tokens with this prompt", flush=True)
    return best[0]


if __name__ == "__main__":
    main()
