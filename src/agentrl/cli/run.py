"""The commands that run the model: eval, rollout, train (Tiers 3 and 2) and sft."""

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agentrl.cli.app import app
from agentrl.cli.display import (console, err, metrics_line, print_curve, print_logprob_check, print_rollout, print_summary,
                                 phase_label, progress_bar, run_line, sft_epoch_line, sft_summary_lines, start_phase, step_info)
from agentrl.cli.options import (ActionSpaceOpt, AdapterOpt, ConfigOpt, DataOpt, EnvWorkersOpt, GateOrTauOpt, GateWarmupOpt, GroupSizeOpt, KVBudgetOpt, LoopGuardOpt, LoraROpt,
                                 MaxNewTokensOpt, ModelOpt, OptBool, OptFloat, OptInt, OptStr, RayAddressOpt, SamplerOpt,
                                 SamplerReplicasOpt, opt, overrides, To)
from agentrl.config import HELDOUT, SPLITS, load_config
from agentrl.errors import RunError, UserError
from agentrl.io import atomic_write_json, atomic_write_text, read_jsonl
from agentrl.models import resolve_model


# ---------------------------------------------------------------- eval
@app.command("eval")
def eval_cmd(
    split: opt(str, "eval.split", f"One of {', '.join(SPLITS)}, or {HELDOUT}: valid_seen and valid_unseen with one model load (OUT/<split> each, the union's summary.json in OUT).") = "valid_seen",
    limit: opt(OptInt, "eval.limit", "Evaluate the first N games of each split (task types interleaved).") = None,
    task_type: opt(Optional[list[str]], "eval.task_types", "Only this task type (repeatable).", "--task-type") = None,
    model: ModelOpt = None,
    adapter: AdapterOpt = None,
    max_steps: opt(OptInt, "eval.max_steps", "T_max per episode (default 30).") = None,
    policy: opt(str, "eval.policy", "model | walkthrough (replays each game's expert walkthrough).") = "model",
    samples: opt(OptInt, "eval.samples", "N episodes per game sampled at the training temperature instead of one greedy episode.") = None,
    rows: opt(OptInt, "eval.rows", "Episodes stepped together (default: as many as the KV budget holds, which follows free memory). A greedy result repeats exactly at the same rows (summary.json's rows_together).") = None,
    max_new_tokens: MaxNewTokensOpt = None,
    sampler: SamplerOpt = None,
    action_space: ActionSpaceOpt = None,
    loop_guard: LoopGuardOpt = None,
    seed: opt(OptInt, "seed", "Run seed.") = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    out: opt(Optional[Path], None, "Output directory (default runs/eval-<split>-<time>).") = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow custom model code from the model directory."),
                                 To("model.trust_remote_code", lambda v: v or None)] = False,
) -> None:
    """Greedy episodes on held-out games; prints success by task type, writes episodes.jsonl and summary.json."""
    cfg = load_config(config, overrides(eval_cmd, locals()))
    if cfg.eval.policy == "model":
        resolve_model(cfg.model.name)  # a missing or unprepared model: one line, before torch loads
    from agentrl.evaluate import prepare_eval, run_evals, summary  # torch: after the config's checks (bad input answers at once)

    out = out or Path("runs") / f"eval-{cfg.eval.split}-{time.strftime('%Y%m%d-%H%M%S')}"
    max_t = cfg.t_max("eval")
    with err.status("loading model" if cfg.eval.policy == "model" else "finding games"):
        games, generator = prepare_eval(cfg)
    several = len(games) > 1
    with progress_bar() as bar:
        loading = bar.add_task("loading games", total=None, info="")
        stepping = bar.add_task("steps", total=max_t, info="", visible=False)

        def on_split(split: str, n: int) -> None:
            if several:  # each split's bars from zero, named
                start_phase(bar, loading, f"loading {split} games", n)
                start_phase(bar, stepping, f"{split} steps", max_t)
                bar.update(stepping, visible=False)

        def on_reset(k: int, n: int) -> None:
            bar.update(loading, completed=k, total=n)

        def on_step(step: int, trajs) -> None:
            bar.update(stepping, completed=step, visible=True, info=step_info(trajs, cut=False))

        results = run_evals(cfg, out, games, generator, on_split, on_step, on_reset)
        bar.update(stepping, completed=max_t)
    for result in results.values():
        print_summary(summary(result, cfg))
    written = [out / s / "episodes.jsonl" for s in games] if several else [out / "episodes.jsonl"]
    console.print(f"wrote {', '.join(map(str, written))} and {out / 'summary.json'}"
                  + (f" (their union; `agentrl compare {out} OTHER` pairs the splits game by game)" if several else ""))


# ---------------------------------------------------------------- rollout
@app.command("rollout")
def rollout_cmd(
    split: opt(OptStr, "rollout.split", f"One of {', '.join(SPLITS)} (default train).") = None,
    tasks: opt(OptInt, "rollout.tasks", "B: number of tasks (groups).") = None,
    skip_tasks: opt(OptInt, "rollout.skip_tasks", "Start after the split's first N games (tasks disjoint from an earlier rollout's).") = None,
    group_size: GroupSizeOpt = None,
    max_steps: opt(OptInt, "rollout.max_steps", "T_max (default 30).") = None,
    gate: opt(OptStr, "rollout.gate", "K,d_L (default 10,0.12), K,auto[:S1+S2+...] (fitted between --rounds; needs --gate-audit), K,nowin (cut groups with no row won by K) or off.") = None,
    gate_or_tau: GateOrTauOpt = None,
    gate_warmup: GateWarmupOpt = None,
    tier1_ab: opt(bool, None, "Baseline vs gated on the same tasks and seeds (Tier 1).", "--tier1-ab") = False,
    tier1_baseline: opt(Optional[Path], None, "Tier 1 against this earlier ungated rollout of the same tasks and seed: only the gated arm runs.", "--tier1-baseline") = None,
    rounds: opt(OptInt, "rollout.rounds", "Roll the tasks in this many consecutive lockstep rounds (fewer rows held at once; an auto gate re-fits between rounds).") = None,
    gate_audit: opt(OptFloat, "select.gate_audit", "Share of the groups the gate would cut that run on anyway: their outcome measures the gate (an auto gate needs it).") = None,
    verify_logprobs: opt(OptBool, "rollout.verify_logprobs", "Then teacher-force every trajectory written through the learner's log-prob path: print the largest, p99.9 and mean |sampler - learner| gap over action tokens, write verify_logprobs.json, exit 1 above the tolerance.", "--verify-logprobs/--no-verify-logprobs") = None,
    verify_tolerance: opt(OptStr, "rollout.verify_tolerance", "The check's bounds: auto (fp32: largest <= 1e-4; bf16: mean <= 5e-3 and p99.9 <= 0.5) | max=X | mean=X,p99.9=Y | X (the largest gap).") = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    temperature: opt(OptFloat, "sampling.temperature", "Sampling temperature (default 0.7).") = None,
    max_new_tokens: MaxNewTokensOpt = None,
    model: ModelOpt = None,
    adapter: AdapterOpt = None,
    sampler: SamplerOpt = None,
    action_space: ActionSpaceOpt = None,
    loop_guard: LoopGuardOpt = None,
    seed: opt(OptInt, "seed", "Run seed (same seed -> same first K steps in both arms).") = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    out: opt(Optional[Path], None, "Output directory (default runs/rollout-<time>).") = None,
) -> None:
    """Roll out B tasks x G trajectories in lockstep with the gate; write trajectories.jsonl and groups.csv."""
    cfg = load_config(config, overrides(rollout_cmd, locals()))
    the_gate = cfg.rollout.parsed_gate()
    if (tier1_ab or tier1_baseline) and the_gate is None:
        raise UserError(f"{'--tier1-ab' if tier1_ab else '--tier1-baseline'} compares no gate with a gate: give --gate K,d_L")
    if tier1_ab and tier1_baseline:
        raise UserError("--tier1-ab runs its own baseline: give it or --tier1-baseline, not both")
    if tier1_baseline is not None:
        from agentrl.collect import read_rollout_summary

        read_rollout_summary(tier1_baseline)  # refused before the model loads
    from agentrl.collect import prepare_rollout, run_rollout, tier1_markdown  # scipy and torch: after the checks above

    out = out or Path("runs") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}"
    t_max = cfg.t_max("rollout")
    with err.status("loading model"):
        games, generator = prepare_rollout(cfg)
    with progress_bar() as bar:
        def progress(name: str):
            task = bar.add_task(name, total=t_max, info="loading games")

            def on_reset(k: int, n: int) -> None:
                bar.update(task, info=f"loading games {k}/{n}")

            def on_step(step: int, trajs) -> None:
                bar.update(task, completed=step, info=step_info(trajs))

            return on_step, on_reset

        result = rollout = run_rollout(cfg, games, generator, out, tier1_ab, progress, tier1_baseline)
    del generator  # closed: its weights and KV store go before a log-prob check loads the learner's
    if tier1_ab:
        console.print(tier1_markdown(result.report))
        console.print(f"wrote {out}/tier1.json, {out}/tier1.md, {out}/baseline/ and {out}/gated/")
    elif tier1_baseline is not None:
        rollout = result.gated
        print_rollout(rollout, the_gate)
        console.print(tier1_markdown(result.report))
        console.print(f"wrote {out / 'trajectories.jsonl'}, {out / 'groups.csv'}, {out}/tier1.json and {out}/tier1.md")
    else:
        print_rollout(rollout, the_gate)
        console.print(f"wrote {out / 'trajectories.jsonl'} and {out / 'groups.csv'}")
    if cfg.rollout.verify_logprobs:
        from agentrl.train.verify import RESULT_FILE, verify_rollout

        arms = ([("baseline", result.baseline.trajectories), ("gated", result.gated.trajectories)] if tier1_ab
                else [("", rollout.trajectories)])
        with err.status("checking log-probs (teacher-forced through the learner)"):
            check = verify_rollout(cfg, arms, out)
        print_logprob_check(check, out / RESULT_FILE)
        if not check.passed:
            raise RunError(check.failure())


# ---------------------------------------------------------------- train
@app.command("train")
def train_cmd(
    out: opt(Optional[Path], None, "Run directory (default runs/train-<time>).") = None,
    resume: opt(Optional[Path], None, "Continue this run directory from its last checkpoint.") = None,
    force: opt(bool, None, "Overwrite a run directory that already holds a run.") = False,
    iterations: opt(OptInt, "train.iterations", "Training iterations (paper: 60).") = None,
    tasks: opt(OptInt, "rollout.tasks", "B: tasks per iteration.") = None,
    group_size: GroupSizeOpt = None,
    max_steps: opt(OptInt, "rollout.max_steps", "T_max of training rollouts.") = None,
    gate: opt(OptStr, "rollout.gate", "K,d_L (e.g. 10,0.12), K,auto[:S1+S2+...] (fitted online; needs --gate-audit), K,nowin (cut groups with no row won by K) or off.") = None,
    gate_or_tau: GateOrTauOpt = None,
    gate_warmup: GateWarmupOpt = None,
    advantage: opt(OptStr, "train.advantage", "grpo | dr_grpo | rloo | gigpo (step-level credit, verl-agent's GiGPO) | raft (A = 1 on a win, 0 otherwise: rejection-sampling fine-tuning online).") = None,
    gamma: opt(OptFloat, "advantage.gamma", "GiGPO: discount of the step-level returns (default 0.95).") = None,
    omega: opt(OptFloat, "advantage.omega", "GiGPO: weight of the step-level advantage (default 1.0).") = None,
    invalid_action_reward: opt(OptFloat, "reward.invalid_action", "Reward of a reply that maps to no admissible command (<= 0; default 0: off).") = None,
    invalid_action_in: opt(OptStr, "reward.invalid_action_in", "Where that penalty enters: return (before the group's normalisation, verl-agent's) or advantage (each invalid reply's, after it; zero-variance groups stay out).") = None,
    mask_cut_replies: opt(OptBool, "advantage.mask_cut_replies", "Replies cut at max_new_tokens get A = 0 (DAPO's overlong filtering, per reply).", "--mask-cut-replies/--no-mask-cut-replies") = None,
    cut_groups: opt(OptStr, "advantage.cut_groups", "The gate's cut groups in the loss: drop (the paper's: out of its N, so the kept rows' step grows) | zero (in at A = 0, counted in N: a cut with no signal leaves the update the ungated run's).") = None,
    select: opt(OptStr, "select.stages", "Rollout-selection stages, e.g. greso,cut,dapo (default: cut when the gate is on).", "--select") = None,
    gate_audit: opt(OptFloat, "select.gate_audit", "Share of the groups the gate would cut that run on anyway (out of the loss): live precision/recall.") = None,
    dapo_refill: opt(OptInt, "select.dapo_refill", "Extra rollout rounds to refill the batch after the DAPO filter.") = None,
    lr: opt(OptFloat, "learner.lr", "AdamW learning rate (paper: 5e-5).") = None,
    loss_agg: opt(OptStr, "learner.loss_agg", "seq-sum | token-mean | seq-mean-token-mean.") = None,
    kl_coef: opt(OptFloat, "learner.kl_coef", "beta of a KL(policy || warm start) penalty, a mean over action tokens (needs --init-adapter; default 0: off). Under seq-sum, the field's 0.01-0.04 is about that x the action tokens of a trajectory.") = None,
    kl_unit: opt(OptStr, "learner.kl_unit", "What --kl-coef multiplies: trained-mean (default) | per-token (the KL aggregated as the loss: beta per action token, the field's unit, as GiGPO's 0.01).") = None,
    replay_coef: opt(OptFloat, "learner.replay_coef", "Success replay: weight of a behaviour-cloning term on earlier iterations' won trajectories (default 0: off).") = None,
    replay_buffer: opt(OptInt, "learner.replay_buffer", "Success replay: won sequences kept, the newest (default 64).") = None,
    eval_every: opt(OptInt, "train.eval_every", "E: greedy held-out eval every E iterations.") = None,
    log_to: opt(OptStr, "train.log_to", "Also log to tensorboard and/or wandb (comma-separated); metrics.jsonl is always written.") = None,
    eval_tasks: opt(OptInt, "train.eval_tasks", "H: held-out tasks per eval.") = None,
    eval_max_steps: opt(OptInt, "train.eval_max_steps", "T_max of the held-out evals (default: the rollouts' T_max).") = None,
    temperature: opt(OptFloat, "sampling.temperature", "Rollout sampling temperature.") = None,
    max_new_tokens: MaxNewTokensOpt = None,
    model: ModelOpt = None,
    sampler: SamplerOpt = None,
    action_space: ActionSpaceOpt = None,
    loop_guard: LoopGuardOpt = None,
    seed: opt(OptInt, "seed", "Run seed (tasks, sampling, LoRA init).") = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
    sampler_replicas: SamplerReplicasOpt = None,
    kv_budget_gb: KVBudgetOpt = None,
    sampler_batch_size: opt(OptInt, "sampling.batch_size", "Trajectories per sampler forward (the live ones are chunked); lower it when one chunk cannot fit the KV budget.") = None,
    micro_batch: opt(OptInt, "learner.micro_batch", "Learner rows per forward/backward (the gradient is the same; lower it when the learner cannot fit).") = None,
    lora_r: LoraROpt = None,
    gradient_checkpointing: opt(OptBool, "learner.gradient_checkpointing", "Recompute each layer in backward: about 1/8 of the learner's activations for a second forward's compute.", "--gradient-checkpointing/--no-gradient-checkpointing") = None,
    sampler_device: opt(OptStr, "model.device", "Device of the sampler (e.g. cuda:0; default auto).") = None,
    learner_device: opt(OptStr, "learner.device", "Device of the learner (e.g. cuda:1: the learner gets its own process).") = None,
    layout: opt(OptStr, "train.layout", "auto | colocate | split (split on CPU: the two-process layout).") = None,
    off_policy: opt(Optional[Path], None, "Tier 2: train on this frozen buffer (trajectories.jsonl of `agentrl rollout --gate off`).", "--off-policy") = None,
    steps: opt(int, None, "Tier 2: optimizer steps per arm.") = 20,
    groups_per_step: opt(int, None, "Tier 2: groups sampled per step.") = 4,
    positions: opt(int, None, "Tier 2: action positions sampled per trajectory.") = 8,
    ab: opt(bool, None, "Tier 2: baseline and gated arms, same groups and seed (Table 4).", "--ab") = False,
    init_adapter: opt(OptStr, "train.init_adapter", "Start from this LoRA adapter, or with learner.lora_r 0 full weights (e.g. `agentrl sft --out DIR`); the sampler serves it as v0.") = None,
) -> None:
    """GRPO on ALFWorld with the gate (Tier 3): rollout, advantages, update, hot-swap, held-out eval.

    With --off-policy BUFFER: Tier 2, updates on a frozen buffer (--ab: baseline vs gated arm)."""
    from agentrl.train import prerun  # loads torch only after the config's own checks

    given = overrides(train_cmd, locals())
    if off_policy is not None:
        cfg = load_config(config, given)
        return offpolicy_cmd(cfg, off_policy, prerun.offpolicy_plan(cfg, out, steps, groups_per_step, positions, ab, force))
    run, cfg = prerun.run_config(out, resume, force, config, given)
    console.print(run_line(run, cfg))
    tasks = prerun.check_run(cfg)
    from agentrl.train import loop  # torch

    with progress_bar() as bar:
        task = bar.add_task("loading models and games", total=None, info="")

        def phase(name: str, total=None, iteration: int = 0) -> None:
            start_phase(bar, task, phase_label(name, iteration, cfg.train.iterations), total)

        hooks = loop.Hooks(phase=phase,
                           step=lambda n, trajs: bar.update(task, completed=n, info=step_info(trajs)),
                           done=lambda row: bar.console.print(metrics_line(row, cfg.train.iterations)),
                           warn=lambda m: bar.console.print(f"[bold yellow]warning:[/] {m}"))
        if resume is None:
            prerun.start_run(run, cfg, force)
        loop.train(cfg, run, resume=resume is not None, hooks=hooks, tasks=tasks)
    print_curve(read_jsonl(run / "metrics.jsonl"), run)
    console.print(f"wrote {run / 'metrics.jsonl'}; figures and tables with `agentrl report {run}`")


def offpolicy_cmd(cfg, buffer_path: Path, plan) -> None:
    """Tier 2: the same sampled groups through a fresh learner per arm; the Table 4 analogue."""
    from agentrl.train.offpolicy import load_buffer, offpolicy_markdown, run_offpolicy_ab  # numpy: not for --help

    buffer = load_buffer(buffer_path)
    if buffer.skipped_cut:
        err.print(f"[yellow]{buffer.skipped_cut} group(s) were cut during the rollout and are skipped "
                  "(make the buffer with --gate off)")
    with progress_bar() as bar:
        task = bar.add_task("loading model", total=plan.steps * len(plan.arms), info="")

        def progress(arm: str, step: int, total: int, row: dict) -> None:
            bar.update(task, description=arm, advance=1, info=f"step {step}/{total}")

        report = run_offpolicy_ab(cfg, buffer, plan.steps, plan.groups_per_step, plan.positions, plan.gate, arms=plan.arms,
                                  progress=progress)
    atomic_write_json(plan.out / "offpolicy.json", report)
    atomic_write_text(plan.out / "offpolicy.md", offpolicy_markdown(report))
    console.print(offpolicy_markdown(report))
    console.print(f"wrote {plan.out / 'offpolicy.json'} and {plan.out / 'offpolicy.md'}")


# ---------------------------------------------------------------- sft
@app.command("sft")
def sft_cmd(
    out: opt(Path, None, "Adapter directory to write (a standard PEFT adapter + agentrl.json + sft_metrics.jsonl; learner.lora_r 0: a model directory)."),
    games: opt(OptInt, "sft.games", "Walkthroughs to learn from, round-robin over task types (default: all of the split).") = None,
    epochs: opt(OptInt, "sft.epochs", "Passes over the walkthroughs (default 2).") = None,
    lr: opt(OptFloat, "sft.lr", "AdamW learning rate (default 5e-4).") = None,
    lora_r: LoraROpt = None,
    expert: opt(OptStr, "sft.expert", "The teacher: walkthrough (each game file's plan, written knowing where everything is; the default) | handcoded (ALFWorld's hand-coded expert, which searches; a game it does not win in sft.expert_max_steps is skipped, counted).") = None,
    decoys: opt(OptInt, "sft.decoys", "Decoy visits: before each walkthrough goes to where it takes the task's object, it first visits N other receptacles that show no such object (played, not taught), so the policy learns to move on where its guess was wrong (default 0: off; measured at 1: worse, the policy learns that the second place holds the object, docs/measurements/decoys.md).") = None,
    heldout_games: opt(OptInt, "sft.heldout_games", "valid_seen walkthroughs for the held-out NLL (0: none).") = None,
    from_: opt(Optional[list[Path]], None, "Clone the won trajectories of this `agentrl rollout` output (trajectories.jsonl or its directory; repeatable) instead of the walkthroughs: rejection-sampling fine-tuning.", "--from") = None,
    relabel: opt(Optional[list[Path]], None, "DAgger: add the states this `agentrl rollout` output's trajectories reached (train games; trajectories.jsonl or its directory; repeatable), each labelled with the PDDL planner's command there, to the walkthroughs of --games.") = None,
    from_walkthroughs: opt(OptInt, "sft.from_walkthroughs", "With --from: also train on the first N walkthroughs of the round robin, beside the wins (default 0: the wins alone).") = None,
    relabel_states: opt(OptInt, "sft.relabel_states", "States labelled per --relabel trajectory: the first where it left the planner's plan, the rest spread over what follows (default 4).") = None,
    relabel_from: opt(OptStr, "sft.relabel_from", "Where --relabel's labels may begin: seen (once an observation named the task's object; the default: before it the planner's command is where the object lies, which the policy cannot know) | start.") = None,
    init_adapter: opt(OptStr, "sft.init_adapter", "Begin from this adapter (e.g. the policy --relabel's rollouts came from) instead of a fresh LoRA.") = None,
    force: opt(bool, None, "Overwrite --out if it exists.") = False,
    reuse: opt(bool, None, "Keep --out if it already holds a warm start of this very recipe (model, LoRA, prompt, sft settings, seed); else build it.") = False,
    resume: opt(bool, None, "Continue the unfinished warm start of this recipe in OUT.partial/ (its checkpoints, every sft.checkpoint_minutes); --no-resume discards it.") = True,
    checkpoint_minutes: opt(OptFloat, "sft.checkpoint_minutes", "Minutes between checkpoints in OUT.partial/ (0: every optimizer step; default 10).") = None,
    model: ModelOpt = None,
    seed: opt(OptInt, "seed", "Seed (LoRA init, batch order).") = None,
    data: DataOpt = None,
    config: ConfigOpt = None,
    env_workers: EnvWorkersOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Warm start: behaviour cloning on expert walkthroughs into the learner's LoRA (then `agentrl train --init-adapter OUT`)."""
    cfg = load_config(config, overrides(sft_cmd, locals()))
    from agentrl.train import sft_plan  # bad input is answered from here, before torch loads

    sources = [sft_plan.rollout_file(p) for p in from_ or []]
    relabel = [sft_plan.rollout_file(p) for p in relabel or []]
    if sources and games is not None:
        raise UserError("--games chooses the walkthroughs, which --from replaces with the won rollouts: "
                        "--from-walkthroughs N trains N of them beside the wins")
    if sources and relabel:
        raise UserError("--from and --relabel make different data sets (won rollouts in place of the walkthroughs; "
                        "labelled states added to them): use one")
    if reuse and (record := sft_plan.reusable(cfg, out, sources, relabel)):
        console.print(f"{out} already holds this warm start ({record['sft']['examples']} examples, "
                      f"{record['sft']['epochs']} epochs, held-out NLL {record['heldout_nll']['after'] or float('nan'):.3f}); reusing it")
        return
    sft_plan.check_out_dir(out, force)
    resolve_model(cfg.model.name)
    if not sources:
        sft_plan.select_games(cfg, cfg.sft.split, cfg.sft.games)  # no data, no games: say so before the progress bar
    from agentrl.train import sft  # torch
    labels = {"replay": "replaying walkthroughs", "heldout": "replaying held-out walkthroughs", "train": "training, optimizer steps",
              "expert": "playing the hand-coded expert", "decoys": "choosing decoy visits", "heldout expert": "playing the hand-coded expert, held-out games",
              "planner": "labelling the trajectories' states with the planner"}
    with progress_bar() as bar:
        task = bar.add_task("loading model and games", total=None, info="")

        def advance(n=1, **info) -> None:
            bar.update(task, advance=n, info=f"nll {info['nll']:.3f}" if "nll" in info else "")

        hooks = sft.SftHooks(phase=lambda name, total=None: start_phase(bar, task, labels.get(name, name), total),
                             advance=advance, done=lambda row: bar.console.print(sft_epoch_line(row)),
                             note=bar.console.print)
        summary = sft.run_sft(cfg, out, force, hooks, sources=sources, resume=resume, relabel=relabel)
    for line in sft_summary_lines(summary, out):
        console.print(line)
