"""Does agentrl learn real ALFWorld? The warm start, then GRPO with and without the gate (a script, not a test).

Runs the commands a user runs, in one work directory, and prints one summary:

1. `agentrl sft` on N train walkthroughs (round-robin over task types)      -> W/warmstart
2. greedy `agentrl eval` of the base model and of the warm start on every valid_seen and every
   valid_unseen game (T_max 30)                                            -> W/eval-*
3. two `agentrl train --init-adapter W/warmstart` runs, same seed: the gate (10, 0.12) with
   --gate-audit, and no gate; `agentrl report` on the pair (the paper's Table 5 analogue)
4. `agentrl rollout --tier1-ab` with the warm start (Table 3 analogue) and `agentrl analyze`
   on its ungated groups

Usage (CPU, about two hours at the defaults; see the README for the GPU line):
    python benchmarks/bench_learning.py --work runs/bench-learning
Every step is skipped when its output already exists, so an interrupted run continues.
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


def run(args: list[str], done: Path, log: Path, parallel: bool = False):
    """Run one agentrl command unless `done` exists; its output goes to `log`."""
    if done.exists():
        print(f"  have {done}")
        return None
    print("  $ agentrl " + " ".join(args), flush=True)
    f = open(log, "a")
    p = subprocess.Popen(AGENTRL + args, stdout=f, stderr=subprocess.STDOUT)
    if parallel:
        return p
    if p.wait() != 0:
        sys.exit(f"failed (exit {p.returncode}): agentrl {' '.join(args)}; see {log}")
    return None


def wait_all(procs: list, log: Path) -> None:
    for p in procs:
        if p is not None and p.wait() != 0:
            sys.exit(f"failed (exit {p.returncode}): {' '.join(p.args)}; see {log}")


def success(summary: Path) -> str:
    o = json.loads(summary.read_text())["overall"]
    return f"{o['won']}/{o['episodes']} ({100 * o['success_rate']:.1f}%)"


def machine() -> str:
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-learning"))
    ap.add_argument("--config", default="configs/learning.yaml", help="the model, LoRA rank and prompt of every step")
    ap.add_argument("--games", type=int, default=120, help="train walkthroughs for the warm start")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out games per split (default: all)")
    ap.add_argument("--base-eval-limit", type=int, default=None, help="held-out games for the base model (default: --eval-limit)")
    ap.add_argument("--arm-eval-limit", type=int, default=None,
                    help="valid_seen games each GRPO arm's final adapter is evaluated on (default: --eval-limit); "
                         "the first N of the warm start's eval, so the two compare game for game")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--tasks", type=int, default=4, help="B")
    ap.add_argument("--group-size", type=int, default=4, help="G")
    ap.add_argument("--eval-tasks", type=int, default=0,
                    help="H: valid_seen games of train's own evals (default 0: each arm's final adapter is evaluated "
                         "afterwards by `agentrl eval` on the warm start's games, so iteration 0 is not run twice)")
    ap.add_argument("--max-steps", type=int, default=30, help="T_max of every rollout and eval")
    ap.add_argument("--gate", default="10,0.12")
    ap.add_argument("--tier1-tasks", type=int, default=16)
    ap.add_argument("--parallel-arms", action="store_true", help="run the two GRPO arms at once (a GPU machine)")
    ap.add_argument("--env-workers", default="auto")
    args = ap.parse_args()

    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    log = w / "commands.log"
    common = ["--config", args.config]
    workers = ["--env-workers", args.env_workers]
    t0 = time.perf_counter()
    timings = {}
    print(f"machine: {machine()}; work dir {w}")

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        timings[name] = round((time.perf_counter() - t) / 60, 2)

    ws = w / "warmstart"
    timed("sft", lambda: run(["sft", "--out", str(ws), "--games", str(args.games), "--epochs", str(args.epochs),
                              *common, *workers], ws, log))

    def evals():
        for split in ("valid_seen", "valid_unseen"):
            for name, extra, limit in (("base", [], args.base_eval_limit or args.eval_limit),
                                       ("warmstart", ["--adapter", str(ws)], args.eval_limit)):
                out = w / f"eval-{name}-{split}"
                lim = ["--limit", str(limit or 100_000)]  # default: every game of the split
                run(["eval", "--split", split, "--max-steps", str(args.max_steps), "--out", str(out), *lim, *extra, *common, *workers],
                    out / "summary.json", log)
    timed("evals", evals)

    def arms():
        procs = []
        for name, gate in (("gated", [args.gate, "--gate-audit", "0.25"]), ("ungated", ["off"])):
            out = w / name
            if (out / "done").exists():
                print(f"  have {out}")
                continue
            a = ["train", "--out", str(out), "--force", "--init-adapter", str(ws), "--iterations", str(args.iterations),
                 "--tasks", str(args.tasks), "-G", str(args.group_size), "--max-steps", str(args.max_steps),
                 "--eval-every", str(args.iterations), "--eval-tasks", str(args.eval_tasks), "--gate", *gate,
                 *common, *workers]
            procs.append((out, run(a, out / "done", log, parallel=True)))
            if not args.parallel_arms:
                wait_all([procs[-1][1]], log)
        wait_all([p for _, p in procs], log)
        for out, _ in procs:
            (out / "done").write_text("")
        run(["report", str(w / "gated"), str(w / "ungated"), "--out", str(w / "report")], w / "report" / "report.md", log)
    timed("grpo", arms)

    def arm_evals():  # each arm's last adapter, greedy, on the games the warm start was evaluated on
        for name in ("gated", "ungated"):
            last = sorted((w / name / "checkpoints").glob("it*"))[-1] / "adapter"
            out = w / f"eval-{name}-valid_seen"
            run(["eval", "--split", "valid_seen", "--max-steps", str(args.max_steps), "--out", str(out),
                 "--limit", str(args.arm_eval_limit or args.eval_limit or 100_000), "--adapter", str(last), *common, *workers],
                out / "summary.json", log)
    timed("arm_evals", arm_evals)

    t1 = w / "tier1"
    timed("tier1", lambda: run(["rollout", "--tier1-ab", "--adapter", str(ws), "--tasks", str(args.tier1_tasks),
                                "-G", str(args.group_size), "--max-steps", str(args.max_steps), "--gate", args.gate, "--out", str(t1),
                                *common, *workers], t1 / "tier1.md", log))
    timed("analyze", lambda: run(["analyze", str(t1 / "baseline" / "groups.csv"), "--out", str(w / "analysis")],
                                 w / "analysis", log))

    lines = [f"# bench_learning ({time.strftime('%Y-%m-%d')}, {machine()})", "",
             f"warm start: {args.games} train walkthroughs, {args.epochs} epochs: "
             + json.dumps(json.loads((ws / 'agentrl.json').read_text()).get("heldout_nll")), "",
             f"| greedy, T_max {args.max_steps} | valid_seen | valid_unseen |", "|---|---|---|"]
    for name in ("base", "warmstart", "gated", "ungated"):
        seen, unseen = (w / f"eval-{name}-{split}" / "summary.json" for split in ("valid_seen", "valid_unseen"))
        label = name if name in ("base", "warmstart") else f"GRPO {name}, {args.iterations} iterations"
        lines.append(f"| {label} | {success(seen)} | {success(unseen) if unseen.exists() else '-'} |")
    if args.arm_eval_limit:  # the warm start on exactly the arms' games: the first N of its eval
        rows = [json.loads(x) for x in (w / "eval-warmstart-valid_seen" / "episodes.jsonl").read_text().splitlines()][: args.arm_eval_limit]
        lines.append(f"| warmstart on the arms' {len(rows)} valid_seen games | {sum(r['won'] for r in rows)}/{len(rows)} | - |")
    lines += ["", f"minutes per step: {json.dumps(timings)}", "", "## GRPO from the warm start: gated vs ungated", "",
              (w / "report" / "report.md").read_text(), "", "## Tier 1 A/B with the warm start", "", (t1 / "tier1.md").read_text()]
    text = "\n".join(lines)
    (w / "summary.md").write_text(text + "\n")
    print(text)
    print(f"\nall done in {(time.perf_counter() - t0) / 60:.1f} min; {w / 'summary.md'}")


if __name__ == "__main__":
    main()
