"""Does agentrl learn real ALFWorld? The warm start, then GRPO arms, evaluated on every held-out game
(a script, not a test).

Runs the commands a user runs, in one work directory, from one config (default
configs/learning.yaml: its sft recipe, B, G, T_max, iterations, gate, learner), and writes a
learning curve:

1. `agentrl sft --config C`                                              -> W/warmstart
2. greedy `agentrl eval` of the warm start on all valid_seen and all valid_unseen games
   (T_max of the config's eval)                                          -> W/eval/warmstart-it0/<split>
3. per arm (default: the config's gate with --gate-audit, and no gate; `penalty`: the gate and
   an invalid-action reward in the return; `penalty-step`: the same in each invalid reply's
   advantage; `mask-cut`: the gate, replies cut at max_new_tokens out of the loss; `kl`: the gate
   and KL to the warm start), `agentrl train
   --init-adapter W/warmstart`, in segments of `--eval-every` iterations (`--resume` between
   them); after each segment its checkpoint's adapter (which carries the warm start's prompt)
   is evaluated like the warm start                                      -> W/<arm>, W/eval/<arm>-itN/<split>
4. the learning curve: success with 95% Wilson intervals vs iteration and vs rollout
   step-tokens, per split and arm (curve.md, curve.csv, curve.png), each arm's last eval paired
   with the warm start's on the same games (exact McNemar), two arms paired with each other, and
   an arm's seeds (ARM, ARM-seedN) as their mean per game against the warm start (exact sign
   test over the games, as `agentrl compare W/eval/warmstart-it0/S W/eval/ARM-itN/S ...`); each
   per split and for both splits together (`both`: `agentrl compare W/eval/warmstart-it0 W/eval/ARM-itN`).

Every command is skipped when its output exists and a killed run resumes from its last
checkpoint, so `python benchmarks/bench_learning.py --work W` run again continues where it
stopped (across sessions too).

Usage:
    python benchmarks/bench_learning.py --work runs/bench-learning                        # configs/learning.yaml (2-core CPU)
    python benchmarks/bench_learning.py --work runs/bench-gpu --config configs/gpu.yaml  # one GPU
    python benchmarks/bench_learning.py --work W --eval-limit 24 --iterations 4           # a smaller reading
    python benchmarks/bench_learning.py --work W --arms gated,gated-seed1                 # a second seed, paired
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

AGENTRL = [sys.executable, "-m", "agentrl.cli"]
SPLITS = ("valid_seen", "valid_unseen")


def run(args: list[str], done: Path, log: Path) -> None:
    """Run one agentrl command unless `done` exists; its output goes to `log`."""
    if done.exists():
        return
    print("  $ agentrl " + " ".join(args), flush=True)
    with open(log, "a") as f:
        f.write(f"\n$ agentrl {' '.join(args)}\n")
        f.flush()
        p = subprocess.run(AGENTRL + args, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        sys.exit(f"failed (exit {p.returncode}): agentrl {' '.join(args)}; see {log}")


def machine() -> str:
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}"


def summary(eval_dir: Path) -> dict:
    return json.loads((eval_dir / "summary.json").read_text())["overall"]


def last_iteration(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip()[2:]) if latest.is_file() else 0


def step_tokens_by_iteration(run_dir: Path) -> dict[int, int]:
    """Cumulative rollout step-tokens after each iteration (metrics.jsonl)."""
    total, out = 0, {0: 0}
    f = run_dir / "metrics.jsonl"
    for line in f.read_text().splitlines() if f.is_file() else []:
        r = json.loads(line)
        if r.get("kind") == "iteration":
            total += r.get("step_tokens_generated", 0)
            out[r["iteration"]] = total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-learning"))
    ap.add_argument("--config", default="configs/learning.yaml", help="every step's settings (sft recipe, B, G, T_max, gate, learner)")
    ap.add_argument("--iterations", type=int, default=None, help="GRPO iterations per arm (default: the config's)")
    ap.add_argument("--eval-every", type=int, default=None, help="iterations between curve points (default: the config's train.eval_every)")
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out games per split (default: all 140 / 134)")
    ap.add_argument("--arms", default="gated,ungated",
                    help="gated (the config's gate, --gate-audit 0.25), ungated, penalty (gated + --invalid-action-reward), "
                         "penalty-step (the same, --invalid-action-in advantage), mask-cut (gated + --mask-cut-replies), kl (gated + --kl-coef); "
                         "ARM-seedN: that arm with run seed N (a second seed: e.g. gated-seed1)")
    ap.add_argument("--invalid-action", default="-0.01", help="the penalty arm's reward of an invalid reply (verl-agent's 0.1 of 10)")
    ap.add_argument("--step-penalty", default="-0.5", help="the penalty-step arm's penalty, added to an invalid reply's "
                                                          "std-normalised advantage (a winner's is about +1 to +2.6 at G 8)")
    ap.add_argument("--kl-coef", default="50", help="the kl arm's beta: a mean over action tokens against seq-sum's per-trajectory "
                                                    "sum of about 250 action tokens (5, about the field's 0.02 token-mean, did not "
                                                    "hold the policy; 50 did: docs/measurements/kl-to-the-warm-start.md)")
    ap.add_argument("--gate-audit", default="0.25")
    ap.add_argument("--env-workers", default="auto")
    ap.add_argument("--midpoint-splits", default=",".join(SPLITS),
                    help="splits evaluated at the curve's inner points (the warm start and each arm's last point: both)")
    args = ap.parse_args()

    cfg = yaml.safe_load(Path(args.config).read_text()) or {}
    train_cfg = cfg.get("train", {})
    iterations = args.iterations or train_cfg.get("iterations", 10)
    every = args.eval_every or train_cfg.get("eval_every", iterations)
    t_max = (cfg.get("eval") or {}).get("max_steps") or (cfg.get("env") or {}).get("max_steps", 30)
    gate = (cfg.get("rollout") or {}).get("gate", "10,0.12")
    arms = {"gated": ["--gate", gate, "--gate-audit", args.gate_audit], "ungated": ["--gate", "off", "--gate-audit", "0"]}
    arms["penalty"] = arms["gated"] + ["--invalid-action-reward", args.invalid_action]
    arms["kl"] = arms["gated"] + ["--kl-coef", args.kl_coef]
    arms["penalty-step"] = arms["gated"] + ["--invalid-action-reward", args.step_penalty, "--invalid-action-in", "advantage"]
    arms["mask-cut"] = arms["gated"] + ["--mask-cut-replies"]
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    for arm in chosen:  # ARM-seedN: the same arm with another run seed (tasks, sampling)
        base, _, seed = arm.partition("-seed")
        if base not in arms or (seed and not seed.isdigit()):
            sys.exit(f"--arms: unknown arm {arm!r} (one of {', '.join(a for a in arms if '-seed' not in a)}, or one of them with -seedN)")
        arms[arm] = arms[base] + (["--seed", seed] if seed else [])
    w = args.work
    (w / "eval").mkdir(parents=True, exist_ok=True)
    log = w / "commands.log"
    common = ["--config", args.config, "--env-workers", args.env_workers]
    t0 = time.perf_counter()
    print(f"machine: {machine()}; work dir {w}; config {args.config}: {iterations} iterations, a curve point every {every}")

    ws = w / "warmstart"
    run(["sft", "--out", str(ws), "--reuse", "--force", "--config", args.config, "--env-workers", args.env_workers],
        ws / "agentrl.json", log)

    def evaluate(name: str, adapter: Path, splits=SPLITS) -> None:
        for split in splits:
            out = w / "eval" / name / split
            run(["eval", "--split", split, "--max-steps", str(t_max), "--limit", str(args.eval_limit or 100_000),
                 "--adapter", str(adapter), "--out", str(out), *common], out / "summary.json", log)

    evaluate("warmstart-it0", ws)
    for arm in chosen:
        out = w / arm
        for target in range(every, iterations + 1, every) if every else [iterations]:
            if last_iteration(out) < target:
                if last_iteration(out) == 0:
                    run(["train", "--out", str(out), "--force", "--init-adapter", str(ws), "--iterations", str(target),
                         "--eval-tasks", "0", *arms[arm], *common], out / "checkpoints" / f"it{target:05d}", log)
                else:
                    run(["train", "--resume", str(out), "--iterations", str(target)],
                        out / "checkpoints" / f"it{target:05d}", log)
            # the checkpoint's adapter carries the warm start's prompt (agentrl.json); copy it before the next segment prunes it
            keep = w / "adapters" / f"{arm}-it{target}"
            if not keep.exists():
                shutil.copytree(out / "checkpoints" / f"it{target:05d}" / "adapter", keep)
            inner = [x.strip() for x in args.midpoint_splits.split(",") if x.strip()]
            evaluate(f"{arm}-it{target}", keep, SPLITS if target + every > iterations else inner)
    write_curve(w, chosen, iterations, every, args.config)
    print(f"\nall done in {(time.perf_counter() - t0) / 60:.1f} min; {w / 'curve.md'}")


def write_curve(w: Path, arms: list[str], iterations: int, every: int, config: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from agentrl.stats import paired, wilson

    rows = []
    points = [("warmstart", 0, w / "eval" / "warmstart-it0")]
    for arm in arms:
        tokens = step_tokens_by_iteration(w / arm)
        points += [(arm, it, w / "eval" / f"{arm}-it{it}") for it in range(every, iterations + 1, every)]
        for split in SPLITS:
            rows.append({"arm": arm, "iteration": 0, "split": split, **point(w / "eval" / "warmstart-it0" / split, 0, wilson)})
        for it in range(every, iterations + 1, every):
            for split in SPLITS:
                d = w / "eval" / f"{arm}-it{it}" / split
                if (d / "summary.json").is_file():
                    rows.append({"arm": arm, "iteration": it, "split": split, **point(d, tokens.get(it), wilson)})
    with open(w / "curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["arm"])
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# Learning curve ({time.strftime('%Y-%m-%d')}, {machine()}, {config})", "",
             "| arm | iteration | rollout step-tokens | split | won | success [95% CI] | valid actions |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['iteration']} | {r['step_tokens'] if r['step_tokens'] is not None else '-'} | {r['split']} | "
                     f"{r['won']}/{r['games']} | {100 * r['success']:.1f}% [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}] | "
                     f"{100 * r['valid_action_rate']:.0f}% |")
    lines += ["", "Paired on the same games (exact McNemar on the discordant games):", "",
              "| comparison | split | games | A | B | B - A (points) | won only by A / B | p |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]

    from agentrl.compare import game_outcomes, pooled_outcomes  # the same reading as `agentrl compare`

    def ready(d: Path, split: str) -> bool:  # "both": the run's eval dir, every split in it
        return all((d / s / "episodes.jsonl").is_file() for s in (SPLITS if split == "both" else [split]))

    def at(d: Path, split: str) -> Path:
        return d if split == "both" else d / split

    def compare(label, a: Path, b: Path, split: str):
        if ready(a, split) and ready(b, split):
            p = paired(game_outcomes(at(a, split))[0], game_outcomes(at(b, split))[0])
            lines.append(f"| {label} | {split} | {p['games']} | {100 * p['success_a']:.1f}% | {100 * p['success_b']:.1f}% | "
                         f"{p['difference_points']:+.1f} | {len(p['won_only_by_a'])} / {len(p['won_only_by_b'])} | {p['mcnemar_p']:.3g} |")

    last = {arm: max((it for a, it, d in points if a == arm and (d / SPLITS[0] / "summary.json").is_file()), default=None)
            for arm in arms}
    for arm in arms:
        if last[arm]:
            for split in (*SPLITS, "both"):
                compare(f"warm start -> {arm} it {last[arm]}", w / "eval" / "warmstart-it0", w / "eval" / f"{arm}-it{last[arm]}", split)
    seeds: dict[str, list[str]] = {}  # ARM and ARM-seedN: one policy, several seeds
    for arm in arms:
        seeds.setdefault(arm.partition("-seed")[0], []).append(arm)
    for base, group in seeds.items():
        its = {last[a] for a in group}
        if len(group) > 1 and len(its) == 1 and None not in its:
            it = its.pop()
            for split in (*SPLITS, "both"):
                dirs = [w / "eval" / f"{a}-it{it}" for a in group]
                if all(ready(d, split) for d in dirs) and ready(w / "eval" / "warmstart-it0", split):
                    # the mean per game, as `agentrl compare A B1 B2`
                    p = paired(game_outcomes(at(w / "eval" / "warmstart-it0", split))[0],
                               pooled_outcomes([at(d, split) for d in dirs])[0])
                    lines.append(f"| warm start -> {base}, mean of {len(group)} seeds, it {it} (sign test) | {split} | {p['games']} | "
                                 f"{100 * p['success_a']:.1f}% | {100 * p['success_b']:.1f}% | {p['difference_points']:+.1f} | "
                                 f"{len(p['won_only_by_a'])} / {len(p['won_only_by_b'])} better | {p['mcnemar_p']:.3g} |")
    if len(arms) == 2 and all(last.values()):
        a, b = arms
        for split in (*SPLITS, "both"):
            compare(f"{a} it {last[a]} -> {b} it {last[b]}", w / "eval" / f"{a}-it{last[a]}", w / "eval" / f"{b}-it{last[b]}", split)
    (w / "curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(w, rows)


def point(d: Path, tokens, wilson) -> dict:
    o = summary(d)
    lo, hi = wilson(o["won"], o["episodes"]) or (0.0, 0.0)
    return {"step_tokens": tokens, "games": o["episodes"], "won": o["won"], "success": o["success_rate"],
            "ci_low": lo, "ci_high": hi, "valid_action_rate": o.get("valid_action_rate") or 0.0}


def plot(w: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xkey, xlabel in ((axes[0], "iteration", "GRPO iteration"), (axes[1], "step_tokens", "rollout step-tokens")):
        for arm, split in sorted({(r["arm"], r["split"]) for r in rows}):  # every arm (zip over 4 styles drew only 2)
            style = "o-" if split == SPLITS[0] else "s--"
            pts = sorted((r for r in rows if r["arm"] == arm and r["split"] == split and r[xkey] is not None), key=lambda r: r[xkey])
            if not pts:
                continue
            x = [r[xkey] for r in pts]
            y = [100 * r["success"] for r in pts]
            err = [[100 * (r["success"] - r["ci_low"]) for r in pts], [100 * (r["ci_high"] - r["success"]) for r in pts]]
            ax.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=f"{arm} · {split}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy success (%) [95% Wilson]")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(w / "curve.png", dpi=120)


if __name__ == "__main__":
    main()
