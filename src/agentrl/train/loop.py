"""`agentrl train` (Tier 3, on-policy): the whole loop on one screen.

    for each iteration:
        rollout = selection.rollout(tasks, B, G, roll)    # select B tasks (seeded; GRESO skips, Pilot-Commit
                                                          # allocates), rollout: G per task in lockstep, the
                                                          # step stages (CUT gate, ARRoL) after env step K
        groups  = selection.keep(rollout, refill, B)      # filter: after-rollout stages (DAPO, with refill)
        batch   = batch_advantages(groups, advantage)     # advantage: Eq. 1 (GiGPO: per step); cut, audited and
                                                          # env-failed groups never enter
        stats   = learner.update(batch)                   # learn: one action-masked GRPO step
        generator.load(learner.save())                    # swap: the sampler uses the new version
        evaluate(held_out) every E iterations             # eval: greedy, disjoint tasks
        selection.observe(rollout.groups)                 # stages learn the outcome (GRESO streaks, ARRoL head)
        metrics.append(...); checkpoint.save(...)         # then the iteration counts as done

A warm start (`--init-adapter DIR`, from `agentrl sft`) is where the learner's LoRA begins and
what the sampler serves as version 0, so iteration 0's eval shows it.

Each named step lives in its own module; the rollout-selection stages (`--select`) are in
agentrl/select/, one small module each behind one protocol. The run directory holds config.yaml (the resolved
config), metrics.jsonl (one line per iteration, one per eval), machine.jsonl (one line per start: the
dtype and machine it ran on), adapters/v{n} and checkpoints/ (see checkpoint.py); `--resume RUN`
continues from the last complete iteration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentrl import faults
from agentrl.config import Config
from agentrl.env import find_games
from agentrl.errors import RunError, UserError
from agentrl.io import atomic_write_text, read_jsonl
from agentrl.machine import append_machine
from agentrl.rollout.generator import EvalResult, Generator
from agentrl.rollout.trajectory import behaviour_metrics, is_zero, played, played_or_stop
from agentrl.select.selection import Selection
from agentrl.stats import wilson
from agentrl.train import checkpoint, heldout
from agentrl.train.advantage import Advantage, advantage_mass, batch_advantages
from agentrl.train.loggers import Loggers
from agentrl.train.remote import LearnerDied, make_learner, resolve_layout

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- select
class TaskSampler:
    """The training pool and the held-out eval tasks. B tasks per iteration, uniformly without
    replacement within an iteration, from a generator seeded with the run seed (saved in checkpoints)."""

    def __init__(self, cfg: Config):
        kind, t = cfg.env.kind, cfg.train
        self.held_out = find_games(kind, t.eval_split, cfg.data.root, limit=t.eval_tasks) if t.eval_tasks else []
        held_ids = {g.game_id for g in self.held_out}
        pool = find_games(kind, cfg.rollout.split, cfg.data.root, cfg.rollout.task_types)
        self.pool = [g for g in pool if g.game_id not in held_ids]  # disjoint even if the splits are the same
        if len(self.pool) < cfg.rollout.tasks:
            raise UserError(f"rollout.tasks={cfg.rollout.tasks} but split {cfg.rollout.split!r} has only "
                            f"{len(self.pool)} training tasks (held-out tasks excluded)")
        self.rng = np.random.default_rng(cfg.seed)

    def select(self, n: int):
        return [self.pool[i] for i in self.rng.choice(len(self.pool), size=n, replace=False)]

    def stream(self):
        """The pool in a fresh random order (a stage that skips tasks draws as many as it needs)."""
        return [self.pool[i] for i in self.rng.permutation(len(self.pool))]

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def iteration_seed(run_seed: int, iteration: int) -> int:
    """Sampling seed of one iteration's rollouts (fresh samples per iteration, same on resume)."""
    return int.from_bytes(hashlib.blake2b(f"{run_seed}/{iteration}".encode(), digest_size=7).digest(), "little")


# ---------------------------------------------------------------- metrics
def iteration_metrics(iteration: int, rollout, batch, stats, timings: dict, adapter_version: int, elapsed_s: float,
                      advantage: Advantage | None = None) -> dict:
    groups = rollout.groups
    uncut = [g for g in groups if not g.cut]
    zero_var = [g for g in uncut if g.zero_variance]
    rewards = [r for g in uncut for r in g.rewards]
    return {
        "kind": "iteration",
        "iteration": iteration,
        "groups": len(groups),
        "groups_cut": len(groups) - len(uncut),
        "zero_variance_groups": len(zero_var),
        "zero_variance_all_fail": sum(g.rewards[0] == 0 for g in zero_var),
        "zero_variance_all_success": sum(g.rewards[0] > 0 for g in zero_var),
        "zero_adv_fraction": float(np.mean([is_zero(a) for _, a in batch])) if batch else None,
        "env_error_trajectories": len(rollout.trajectories) - len(played(rollout.trajectories)),
        "grad_l2_norm": stats.grad_l2_norm,  # the first optimizer step's (comparable with single-step runs)
        "loss": stats.loss,
        # over every optimizer step of the update (learner.epochs x minibatches)
        "loss_mean": stats.loss_mean,
        "grad_l2_norm_mean": stats.grad_l2_norm_mean,
        "grad_l2_norm_max": stats.grad_l2_norm_max,
        "train_reward": float(np.mean(rewards)) if rewards else None,
        # every trajectory of the iteration, a cut one as it stood at its cut (a lower bound where the gate cut:
        # train_reward above leaves the cut groups out, so it rises when a gate cuts failing groups)
        "train_success": float(np.mean([t.won for g in groups for t in [*g.trajectories, *g.pruned]])) if groups else None,
        "step_tokens_trained": stats.step_tokens_trained,
        "trajectories_trained": sum(not is_zero(a) for _, a in batch),
        # the advantage in the loss vs in the groups the gate cut (audited ones ran on: known)
        "advantage_mass": advantage_mass(groups, batch, advantage or Advantage()),
        **{k: round(v, 4) for k, v in timings.items()},
        "elapsed_s": round(elapsed_s, 4),
        "adapter_version": adapter_version,
        # the adapter versions the sampler actually served this iteration's rollouts with (0 = base)
        "rollout_adapter_versions": sorted({v or 0 for t in rollout.trajectories for v in t.adapter_versions}),
        "logprob_gap": stats.logprob_gap,
        "skipped_update": stats.skipped,
        # learner.epochs x minibatches: the steps taken, the share of action tokens clipped, KL to the warm start
        "optimizer_steps": stats.optimizer_steps if stats.stepped else 0,
        "clip_fraction": stats.clip_fraction,
        "kl_to_warm_start": stats.kl,
        "kl_coef_field": stats.kl_coef_field,  # learner.kl_coef per action token, as the policy term weighs it
        # success replay (learner.replay_coef): the replayed wins' mean NLL per action token, the buffer's size
        "replay_nll": stats.replay_nll,
        "replay_buffer": stats.replay_buffer,
        **behaviour_metrics(rollout.trajectories),
    }


class Metrics:
    """RUN/metrics.jsonl: appended one fsynced line at a time; on resume cut back to the checkpoint.
    The loggers of `train.log_to` (TensorBoard, W&B) get every row once it is on disk."""

    def __init__(self, path: Path, log_to: str | None = None, cfg=None):
        self.path, self.log_to, self.cfg = path, log_to, cfg
        self.loggers = None  # opened by truncate_after, once the run's first iteration is known

    def append(self, *rows: dict) -> None:
        try:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # disk full: a torn line is cut at resume, the checkpoint is untouched
            raise RunError(f"cannot write {self.path}: {e.strerror or e}; the run keeps its last checkpoint: "
                           f"fix it, then `agentrl train --resume {self.path.parent}`") from None
        if self.loggers is not None:
            self.loggers.log(*rows)

    def close(self) -> None:
        if self.loggers is not None:
            self.loggers.close()

    def truncate_after(self, iteration: int, keep=lambda row: False) -> list[dict]:
        """Keep the complete lines of iterations <= `iteration` and those `keep` accepts (a torn or
        other line is dropped); return the kept rows."""
        rows = read_jsonl(self.path) if self.path.is_file() else []  # each line as Metrics.write wrote it
        kept = [row for row in rows if isinstance(row, dict) and (row.get("iteration", iteration + 1) <= iteration or keep(row))]
        atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in kept))
        if self.log_to and self.loggers is None:
            # from a checkpoint at `iteration` the loggers continue after it; else the run starts over
            self.loggers = Loggers(self.log_to, self.path.parent, self.cfg, start_iteration=max(0, iteration + 1))
        return kept


# ---------------------------------------------------------------- eval
def evaluate(cfg: Config, generator: Generator, games, iteration: int, adapter_version: int, on_step=None) -> dict:
    """Greedy episodes on the held-out tasks with the sampler's current weights: their metrics row."""
    result = generator.evaluate(games, cfg.train.eval_split, cfg.t_max("train_eval"), on_step=on_step,
                                what=f"held-out episodes of iteration {iteration}")
    return eval_row(result, iteration, adapter_version)


def eval_row(result: EvalResult, iteration: int, adapter_version: int) -> dict:
    """metrics.jsonl's eval row: a projection of the EvalResult (report.py and compare.py read it)."""
    ran, b = played(result.trajectories), result.overall
    return {
        "kind": "eval", "iteration": iteration, "split": result.split, "tasks": b["episodes"],
        "env_errors": b["env_errors"], "success": b["success_rate"], "won": b["won"],
        "ci95": list(wilson(b["won"], b["episodes"]) or (0.0, 0.0)),  # a 6-game eval reads as what it is
        "outcomes": {t.game.game_id: int(t.won) for t in ran},  # per game: evals pair across iterations
        "by_task_type": {k: {"episodes": v["episodes"], "success": v["success_rate"]}
                         for k, v in result.by_task_type.items() if v["episodes"]},
        "eval_s": round(result.elapsed_s, 4), "adapter_version": adapter_version,
        # a greedy bf16 eval repeats exactly only at the same rows stepped together (summary.json's too)
        **({"rows_together": result.memory["rows_together"]} if result.memory else {}),
        **{k: v for k, v in behaviour_metrics(result.trajectories).items() if k != "success_by_task_type"},
    }


# ---------------------------------------------------------------- the loop
@dataclass
class Hooks:
    """Progress callbacks (the CLI draws them with rich; tests leave them out)."""

    phase: callable = lambda name, total=None, iteration=0: None  # "rollout" | "train" | "swap" | "eval" | "base_eval"
    step: callable = lambda step, trajs: None
    done: callable = lambda row: None  # each metrics line as it is written
    warn: callable = field(default=lambda message: log.warning("%s", message))


def train(cfg: Config, run: Path, resume: bool = False, hooks: Hooks | None = None, sampler=None, learner=None,
          tasks: TaskSampler | None = None) -> dict:
    """Run (or continue) a training run in `run`; return the last iteration's metrics line."""
    hooks = hooks or Hooks()
    tasks = tasks or TaskSampler(cfg)
    owned = learner is None
    generator = None
    try:
        # the env workers start while the model loads; a sampler made here is closed with the generator
        generator = Generator(cfg, sampler, colocated=resolve_layout(cfg) == "colocate")
        learner = learner or make_learner(cfg)  # in this process, or its own (the two-device layout)
        metrics = Metrics(run / "metrics.jsonl", cfg.train.log_to, cfg)
        append_machine(run / "machine.jsonl", cfg, resume=resume)  # a resumed run may continue elsewhere
        try:
            return _loop(cfg, run, resume, hooks, tasks, generator, learner, metrics)
        finally:
            metrics.close()
    except LearnerDied as e:
        raise LearnerDied(f"{e}; the run keeps its last complete iteration: continue with `agentrl train --resume {run}`") from None
    finally:
        if generator is not None:
            generator.close()
        if owned and learner is not None:
            learner.close()


def _loop(cfg: Config, run: Path, resume: bool, hooks: Hooks, tasks: TaskSampler, generator: Generator, learner,
          metrics: Metrics) -> dict:
    sampler = generator.sampler
    selection = Selection(cfg, sampler, hooks.warn)  # the --select stages, their state restored on resume
    advantage = Advantage.of(cfg)  # --advantage with advantage.* and reward.*
    state = checkpoint.TrainState()
    last = checkpoint.latest(run) if resume else None
    row: dict = {}
    if resume:
        checkpoint.clean_partial(run)  # what a kill left half-written
    if last is not None:
        state, weights = checkpoint.load(last, learner)
        tasks.restore(state.task_rng)
        selection.load_state_dict(state.select)
        generator.load(weights)
        metrics.truncate_after(state.iteration)
    else:  # no checkpoint: start over, keeping iteration 0's evals on record for the same weights and games
        recorded = heldout.on_record(cfg, tasks.held_out) if resume else {}
        kept = metrics.truncate_after(-1, keep=heldout.keeps(recorded))
        # the base model's eval (train.eval_base), then the warm start (`agentrl sft`) served as version 0 and its eval
        row, spent = heldout.iteration0(cfg, generator, tasks.held_out, metrics, hooks, evaluate, kept)
        state.elapsed_s += spent
    E = cfg.train.eval_every
    eval_steps = cfg.t_max("train_eval")

    for it in range(state.iteration + 1, cfg.train.iterations + 1):
        t0 = time.perf_counter()
        faults.iteration = it
        selection.begin(it)
        hooks.phase("rollout", cfg.t_max("rollout"), iteration=it)
        roll = generator.roller(iteration_seed(cfg.seed, it), hooks.step)
        rollout = selection.rollout(tasks, cfg.rollout.tasks, cfg.rollout.group_size, roll)  # select + rollout + gate
        refill = lambda n: roll(selection.refill_tasks(tasks, n), stages=selection.step_stages)  # noqa: E731
        groups = selection.keep(rollout, refill, cfg.rollout.tasks)                              # filter
        t1 = time.perf_counter()
        check_served_version(it, rollout, learner.version, hooks.warn)
        check_env_failures(it, rollout, hooks.warn)
        batch = batch_advantages(groups, advantage)                                               # advantage
        hooks.phase("train", iteration=it)
        sampler.sleep()  # a colocated vLLM engine lends the GPU to the update; the swap wakes it
        stats = learner.update(batch)                                                             # learn
        t2 = time.perf_counter()
        if stats.stepped:                                                                         # swap
            hooks.phase("swap", iteration=it)
            generator.load(learner.save(run / "adapters"))
            prune_adapters(run / "adapters", cfg.train.keep_adapters)
        t3 = time.perf_counter()
        state.bad_updates = state.bad_updates + 1 if stats.skipped else 0
        check_update(it, stats, cfg.train.logprob_gap_warn, hooks.warn)
        eval_row = None
        if tasks.held_out and (it == cfg.train.iterations or (E and it % E == 0)):               # eval
            hooks.phase("eval", eval_steps, iteration=it)
            eval_row = evaluate(cfg, generator, tasks.held_out, it, learner.version, hooks.step)
        t4 = time.perf_counter()
        state.iteration, state.adapter_version = it, learner.version
        state.elapsed_s += t4 - t0
        state.task_rng = tasks.state()
        timings = {"rollout_s": t1 - t0, "train_s": t2 - t1, "swap_s": t3 - t2, "eval_s": t4 - t3, "iteration_s": t4 - t0}
        selection.observe(rollout.groups)
        state.select = selection.state_dict()
        row = iteration_metrics(it, rollout, batch, stats, timings, learner.version, state.elapsed_s, advantage)
        row |= selection.metrics(rollout.groups, batch)
        metrics.append(row, *([eval_row] if eval_row else []))
        faults.point("metrics")
        checkpoint.save(run, state, learner)                                                      # now it counts
        hooks.done(row)
        if eval_row:
            hooks.done(eval_row)
        if state.bad_updates >= cfg.train.max_bad_updates:
            raise UserError(f"{state.bad_updates} non-finite updates in a row (last at iteration {it}); stopping. "
                            f"Lower learner.lr or enable learner.grad_clip, then --resume {run}")
    return row


def check_served_version(it: int, rollout, expected: int, warn) -> None:
    """Every trajectory must have been sampled with the learner's latest adapter (0 = base)."""
    served = {v or 0 for t in rollout.trajectories for v in t.adapter_versions}
    if served - {expected}:
        warn(f"iteration {it}: rollouts used adapter version(s) {sorted(served)}, the learner is at "
             f"v{expected}: the sampler did not swap in the latest adapter")


def check_env_failures(it: int, rollout, warn) -> None:
    """Groups an env failure touched stay out of the loss (batch_advantages); an iteration whose
    every env failed stops the run: it would otherwise go on 'training' on nothing."""
    played_or_stop(rollout.trajectories, f"trajectories of iteration {it}; stopping, the run keeps its last checkpoint")
    failed = [t for t in rollout.trajectories if t.stop_reason == "env_error"]
    if failed:
        warn(f"iteration {it}: the env failed on {len(failed)} trajectories; their {sum(g.env_failed for g in rollout.groups)} "
             f"group(s) stay out of the loss (first: {failed[0].error})")


def check_update(it: int, stats, gap_threshold: float, warn) -> None:
    if stats.skipped:
        warn(f"iteration {it}: non-finite loss or gradient (loss {stats.loss}, grad norm {stats.grad_l2_norm}); update skipped")
    if stats.logprob_gap is not None and stats.logprob_gap > gap_threshold:
        warn(f"iteration {it}: sampler and learner disagree on action log-probs by {stats.logprob_gap:.3f} on average "
             f"(> {gap_threshold}): a stale adapter or a tokenisation mismatch")


def prune_adapters(root: Path, keep: int) -> None:
    versions = sorted((p for p in root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
