"""Before `agentrl train` writes anything: which run directory and config (a fresh run, or
--resume's policy), and the checks that refuse a run up front, cheapest and the user's own files
first, then whether this machine holds it (KV cache, learner), then the cluster; then the first
thing it writes (`start_run`: the directory and its config.yaml)."""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from agentrl import cluster
from agentrl.config import Config, load_config
from agentrl.errors import UserError
from agentrl.io import atomic_write_text
from agentrl.models import check_full_weights, check_lora_adapter, resolve_model
from agentrl.sampling.replicas import check_replicas
from agentrl.specs import GateSpec
from agentrl.weights import refuse_full_init, weights_kind

if TYPE_CHECKING:
    from agentrl.train.loop import TaskSampler

# The checks that need torch (the loop, the learner, the memory plans) are imported where they
# run, after the config's own: bad input to `agentrl train` answers in a second, not after ~5 s of imports.

# What --resume may change: the iteration count, where things run and memory settings; none of
# them changes a gradient, so the continued run is the run it was.
MAY_CHANGE_ON_RESUME = ("train.iterations", "model.device", "learner.device", "train.layout", "env.workers",
                        "cluster.ray_address", "sampling.replicas", "sampling.kv_budget_gb", "sampling.batch_size",
                        "learner.micro_batch", "learner.gradient_checkpointing")


def run_config(out: Path | None, resume: Path | None, force: bool, config: Path | None,
               overrides: dict) -> tuple[Path, Config]:
    """(run directory, config) of `agentrl train`: a fresh run in `out` (default runs/train-<time>)
    from `config` + `overrides`, or --resume's run with its own config.yaml, where only the
    settings of MAY_CHANGE_ON_RESUME may be given."""
    if resume is None:
        run = out or Path("runs") / f"train-{time.strftime('%Y%m%d-%H%M%S')}"
        return run, prepare_run(run, check_kl_reference(load_config(config, overrides)), resume=False, force=force)
    changed = [k for k, v in overrides.items() if v is not None and k not in MAY_CHANGE_ON_RESUME]
    if changed or config or out:
        raise UserError(f"--resume continues {resume} with its own config.yaml; only --iterations, the devices, --env-workers, --ray-address, --sampler-replicas, --kv-budget-gb, --sampler-batch-size, "
                        "--micro-batch and --gradient-checkpointing "
                        f"may change (got {', '.join(changed + (['--config'] if config else []) + (['--out'] if out else []))})")
    return resume, prepare_run(resume, None, resume=True, force=False,
                               overrides={k: overrides.get(k) for k in MAY_CHANGE_ON_RESUME})


def prepare_run(run: Path, cfg: Config | None, resume: bool, force: bool, overrides: dict | None = None) -> Config:
    """Check the run directory before anything is loaded; return the config the run uses.

    A fresh run refuses a directory that already holds a run (unless --force); --resume reads
    the run's own config.yaml (`overrides`: only the iteration count and devices may change)."""
    config_file = run / "config.yaml"
    if resume:
        if not config_file.is_file():
            raise UserError(f"cannot resume {run}: no config.yaml there (not an agentrl train run directory)")
        return load_config(config_file, overrides)
    assert cfg is not None
    if run.exists() and any(run.iterdir()):
        if not force:
            raise UserError(f"{run} already holds a run; continue it with --resume {run} or overwrite it with --force")
    return cfg


def start_run(run: Path, cfg: Config, force: bool) -> None:
    if force and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run / "config.yaml", yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def check_kl_reference(cfg: Config) -> Config:
    """A KL penalty holds the policy to the warm start: a run with learner.kl_coef > 0 needs one
    (a shipped config, configs/gigpo.yaml, carries the recipe's beta; --init-adapter gives the warm start)."""
    if cfg.learner.kl_coef > 0 and not cfg.train.init_adapter:
        raise UserError("learner.kl_coef > 0 needs a reference: the warm start (--init-adapter DIR)")
    return cfg


def check_run(cfg: Config) -> TaskSampler:
    """Refuse a run that cannot go before its directory is written; return its task sampler
    (which has found the games)."""
    resolve_model(cfg.model.name)
    init = cfg.train.init_adapter
    if init and weights_kind(init) == "full":  # the user's files first, then whether this machine's memory holds the run
        refuse_full_init(cfg.learner.lora_r, init)
        check_full_weights(init, cfg.model.name, cfg.model.trust_remote_code)
    elif init:
        check_lora_adapter(init, cfg.model.name, cfg.model.trust_remote_code)
    from agentrl.rollout.plan import check_kv_fits
    from agentrl.train.loop import TaskSampler
    from agentrl.train.memory import check_learner_fits

    t_max = cfg.rollout.max_steps or cfg.env.max_steps
    check_kv_fits(cfg, cfg.rollout.tasks * cfg.rollout.group_size, t_max, "train's rollouts")
    check_kv_fits(cfg, min(1, cfg.train.eval_tasks), cfg.train.eval_max_steps or t_max, "train's held-out eval")  # run in slices
    check_learner_fits(cfg, t_max)
    tasks = TaskSampler(cfg)
    if cfg.cluster.ray_address:  # no cluster there, or too few GPUs for the replicas: refused before the run is written
        cluster.connect_for(cfg)
        check_replicas(cfg)
    return tasks


@dataclass(frozen=True)
class OffPolicyPlan:
    """What `agentrl train --off-policy` runs: where it writes, the gate, the arms and the sizes."""

    out: Path
    gate: GateSpec | None
    arms: tuple[str, ...]
    steps: int
    groups_per_step: int
    positions: int


def offpolicy_plan(cfg: Config, out: Path | None, steps: int, groups_per_step: int, positions: int, ab: bool,
                   force: bool) -> OffPolicyPlan:
    """Tier 2's checks before the buffer is read."""
    for name, value in (("--steps", steps), ("--groups-per-step", groups_per_step), ("--positions", positions)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    check_kl_reference(cfg)
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
    return OffPolicyPlan(out, gate, arms, steps, groups_per_step, positions)
