"""GRPO vs GiGPO on real ALFWorld games, and what the gate drops under each (a script, not a test).

From one warm start and one seed, `agentrl train` once per advantage estimator, with the gate
and `--gate-audit 1`: every group the gate would cut runs to the end and stays out of the loss,
so its advantages are known and the advantage mass a cut drops is measured, not guessed. Prints
one table: held-out greedy success before and after, step-tokens generated and trained,
zero-variance groups, trajectories trained, the advantage L2 in the loss vs in the would-cut
groups, and the share of each iteration's advantage mass the gate dropped.

Usage (CPU, 2 cores: about 20 minutes per arm at the defaults):
    python benchmarks/bench_gigpo.py --work runs/bench-gigpo
The warm start is make train's (configs/default.yaml, cached in ~/.cache/agentrl/warmstart/default;
built first when missing). Every arm is skipped when its run already finished, so an interrupted
run continues.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

AGENTRL = [sys.executable, "-m", "agentrl.cli"]
WARMSTART = Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl")) / "warmstart" / "default"


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def agentrl(args: list[str], log: Path) -> None:
    print("  $ agentrl " + " ".join(args), flush=True)
    with open(log, "a") as f:
        if subprocess.run(AGENTRL + args, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            sys.exit(f"failed: agentrl {' '.join(args)}; see {log}")


def summarise(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if r["kind"] == "iteration"]
    evals = [r for r in rows if r["kind"] == "eval"]
    total = lambda key: sum(r.get(key) or 0 for r in its)  # noqa: E731
    mass = [r["advantage_mass"] for r in its]
    shares = [m["dropped_share_est"] for m in mass if m.get("dropped_share_est") is not None]
    return {
        "iterations": len(its),
        "held_out": f"{100 * evals[0]['success']:.1f}% -> {100 * evals[-1]['success']:.1f}% ({evals[-1]['tasks']} games)",
        "train_reward": round(sum(r["train_reward"] or 0 for r in its) / len(its), 3),
        "step_tokens": f"{total('step_tokens_generated')} / {total('step_tokens_trained')}",
        "zero_var_groups": f"{total('zero_variance_groups')} of {total('groups')}",
        "trajectories_trained": f"{total('trajectories_trained')} of {total('trajectories_generated')}",
        "would_cut_groups": sum(m["audited_groups"] + m["cut_groups"] for m in mass),
        "adv_l2_loss": round(sum(m["kept_l2"] ** 2 for m in mass) ** 0.5, 3),
        "adv_l2_would_cut": round(sum(m["audited_l2"] ** 2 for m in mass) ** 0.5, 3),
        "dropped_share": f"{100 * sum(shares) / len(shares):.1f}%" if shares else "-",
        "step_group_size": (round(sum(m["step_group_size_mean"] or 0 for m in mass) / len(mass), 2)
                            if mass and "step_group_size_mean" in mass[0] else "-"),
        "train_s": round(total("train_s"), 1),
        "rollout_s": round(total("rollout_s"), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-gigpo"))
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--warmstart", type=Path, default=WARMSTART)
    ap.add_argument("--arms", default="grpo,gigpo", help="advantage estimators, one run each")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--gate", default="6,0.25", help="K,d_L (audited: every would-cut group runs on)")
    ap.add_argument("--eval-tasks", type=int, default=6)
    ap.add_argument("--invalid-action-reward", type=float, default=0.0)
    ap.add_argument("--extra", default="", help="more `agentrl train` flags for every arm")
    args = ap.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    log = w / "commands.log"
    print(f"machine: {machine()}; work dir {w}")
    if not (args.warmstart / "adapter_model.safetensors").exists():
        agentrl(["sft", "--config", args.config, "--out", str(args.warmstart), "--reuse"], log)
    results = {}
    for arm in args.arms.split(","):
        run = w / arm
        if not (run / "done").exists():
            t = time.perf_counter()
            agentrl(["train", "--config", args.config, "--out", str(run), "--force", "--init-adapter", str(args.warmstart),
                     "--advantage", arm, "--iterations", str(args.iterations), "--eval-every", str(args.iterations),
                     "--eval-tasks", str(args.eval_tasks), "--gate", args.gate, "--gate-audit", "1",
                     "--invalid-action-reward", str(args.invalid_action_reward), *args.extra.split()], log)
            (run / "done").write_text(f"{time.perf_counter() - t:.0f} s\n")
        results[arm] = summarise(run) | {"wall_s": (run / "done").read_text().strip()}
    keys = list(next(iter(results.values())))
    lines = [f"# bench_gigpo ({time.strftime('%Y-%m-%d')}, {machine()})", "",
             f"config {args.config}, warm start {args.warmstart}, gate {args.gate} with --gate-audit 1, "
             f"invalid-action reward {args.invalid_action_reward}", "",
             "| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    lines += [f"| {k} | " + " | ".join(str(r[k]) for r in results.values()) + " |" for k in keys]
    text = "\n".join(lines)
    (w / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
