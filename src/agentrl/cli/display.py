"""What the commands print: progress bars (a plain line a minute in a log), tables and lines."""

from __future__ import annotations

import os
import threading
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from rich.table import Table

from agentrl.analysis.summary import signal_choice
from agentrl.config import TASK_TYPES
from agentrl.report import transposed
from agentrl.specs import _SHORT
from agentrl.stats import eval_text, learning_verdict, warm_start_verdict, wilson
from agentrl.train.totals import run_totals

LOG_WIDTH = 120  # a log's columns: the tables' task-type names and a progress line fit on one line


def _console(stderr: bool = False) -> Console:
    """A console that is rich's own on a terminal; in a log (`| tee`, `> log`) with no COLUMNS set,
    LOG_WIDTH columns instead of rich's 80, which cut task types to `pick_…` and wrapped every
    progress line. Decided at import, as the process starts (its streams already redirected)."""
    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c.width = LOG_WIDTH
    return c


console = _console()
err = _console(stderr=True)


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
        left = remaining_s(task)  # every call: it keeps the phase's pace from its first update
        now = time.monotonic()
        last = getattr(task, "_agentrl_printed", None)
        if last is None:
            task._agentrl_printed = now  # the first line comes a minute in: short work prints nothing
        elif now - last >= self.every_s:
            task._agentrl_printed = now
            done = f"{task.completed:.0f}/{task.total:.0f}" if task.total is not None else ""  # no count where none is kept
            parts = (task.description, done, task.fields.get("info", ""),
                     f"{time.strftime('%H:%M:%S', time.gmtime(task.elapsed or 0))} elapsed",
                     f"~{hms(left)} left" if left is not None else "")
            self.console.print("  ".join(x for x in parts if x), markup=False, highlight=False)


def start_phase(bar: Progress, task, description: str, total: float | None = None) -> None:
    """Turn the bar's task into the next phase, its clock restarted: the elapsed time shown is the
    phase's own (rich also freezes a task's clock once it first completes, so without the reset
    the warm start's 60/60 would read the replay's 1 minute). rich keeps the old total when given
    None, so a phase without one (the learner's update) would read as the last one's "0/30"."""
    bar.reset(task, description=description, completed=0, info="")
    for t in bar.tasks:
        if t.id == task:
            t.total = total
            t._agentrl_pace = (0, None)  # the phase's first progress starts its pace (remaining_s)


def remaining_s(task) -> float | None:
    """Seconds the phase has left at its pace since its first progress, None before more progress
    or without a total. The pace starts at the first unit done, not at the phase's start: a first
    unit carries one-off work (an eval's first step prefills every game's prompt, several later
    steps' worth), and a resumed warm start's jump to the step it continues from is not speed."""
    now = time.monotonic()
    start, when = getattr(task, "_agentrl_pace", None) or (task.completed, None)  # no phase started: from here
    if when is None:  # waiting for the phase's first unit
        task._agentrl_pace = (task.completed, now) if task.completed != start else (start, None)
        return None
    done, seconds = task.completed - start, now - when
    if task.total is None or done <= 0 or seconds <= 0:
        return None
    return max(0.0, task.total - task.completed) * seconds / done


def hms(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 3600:.0f} h"


class RemainingColumn(ProgressColumn):
    """`~H:MM:SS left` at the phase's own pace (remaining_s); nothing until it has one."""

    def render(self, task) -> Text:
        left = remaining_s(task)
        return Text(f"~{hms(left)} left" if left is not None else "", style="progress.remaining")


def progress_bar() -> Progress:
    """Step bars on stderr: description, bar, step n/T, live/won/cut info, elapsed, time left at
    the phase's pace (plain lines every minute when stderr is not a terminal)."""
    cls = Progress if err.is_terminal else LineProgress
    return cls(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), RemainingColumn(), console=err)


def table(title: str, columns, left=()) -> Table:
    """A table whose columns are right-aligned except those in `left` (or all when left is True)."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if left is True or col in left else "right")
    return t


def step_info(trajs, cut: bool = True) -> str:
    """live / cut / won counts of the trajectories being stepped (the bars' info field)."""
    live, won = sum(not t.done for t in trajs), sum(t.won for t in trajs)
    cuts = f"  cut {sum(t.stop_reason == 'gate_cut' for t in trajs)}" if cut else ""
    return f"live {live}{cuts}  won {won}/{len(trajs)}"


# ---------------------------------------------------------------- eval, rollout
def together(s: dict) -> str:
    """Where an eval ran in slices: how many episodes it stepped together, which a repeat needs to
    give the same greedy outcomes (batches move reduced-precision numerics)."""
    rows, episodes = (s.get("memory") or {}).get("rows_together"), s["overall"]["episodes"]
    return f" · {rows} of {episodes} episodes stepped together (--rows {rows} repeats it)" if rows and rows < episodes else ""


def print_summary(s: dict) -> None:
    title = f"{s['split']} · policy {s['policy']}" + (f" · model {s['model']}" if s["model"] else "")
    if s.get("samples"):
        title += f" · {s['samples']} episodes per game at temperature {s['temperature']} (interval: bootstrap over games)"
    t = table(title, ("task type", "episodes", "won", "success", "95% CI", "valid actions", "mean steps", "invalid/ep"),
              left=("task type",))

    def row(name: str, b: dict, style: str | None = None) -> None:
        lo, hi = b.get("ci95") or wilson(b["won"], b["episodes"]) or (0.0, 0.0)
        valid = b.get("valid_action_rate")
        t.add_row(name, str(b["episodes"]), str(b["won"]), f"{100 * b['success_rate']:.1f}%",
                  f"{100 * lo:.1f}–{100 * hi:.1f}%", "-" if valid is None else f"{100 * valid:.0f}%",
                  f"{b['mean_steps']:.1f}", f"{b['invalid_actions_per_episode']:.1f}", style=style)

    for name, b in s["by_task_type"].items():
        row(name, b)
    row("overall", s["overall"], style="bold")
    console.print(t)
    if s["overall"].get("looped_rate"):  # a line of its own: one more column truncates the table at 80
        console.print(f"looped: {pct(s['overall']['looped_rate'])} of the episodes ran out of steps going round a cycle")
    if s["overall"].get("other_object_rate") is not None:
        console.print(f"other object: {pct(s['overall']['other_object_rate'])} of the episodes that took something "
                      "took another object than the task's first")
    if s["overall"].get("guarded_rate"):
        console.print(f"loop guard: narrowed the choice at {pct(s['overall']['guarded_rate'])} of the steps")
    tm = s["timing"]
    console.print(
        f"wall {tm['wall_s']:.1f}s (generate {tm['generate_s']:.1f}s, env {tm['env_s']:.1f}s) · "
        f"{tm['s_per_step']:.2f}s per lockstep step · {tm['s_per_task']:.2f}s per task · {tm['env_steps']} env steps"
        + together(s)
    )
    for e in s["errors"]:
        err.print(f"[yellow]skipped {e['task_id']}: {e['error']}")
    if s.get("walkthroughs"):
        w = s["walkthroughs"]
        console.print(f"playable: {w['won']} of {s['overall']['episodes']} walkthroughs win; {len(w['unwinnable'])} do not "
                      f"(agentrl sft skips them, counted)"
                      + (f"; {len(w['longer_than_t_max'])} are longer than T_max {s['max_steps']} (raise --max-steps)"
                         if w["longer_than_t_max"] else ""))
        for g in w["unwinnable"][:5]:
            console.print(f"  does not win: {escape(g)}")
        if len(w["unwinnable"]) > 5:
            console.print(f"  ... and {len(w['unwinnable']) - 5} more")
    if s["overall"].get("env_errors"):
        err.print(f"[yellow]{s['overall']['env_errors']} episode(s) the env could not run are left out of the "
                  f"success rate and its interval ({s['overall']['episodes']} played)")


def print_rollout(rollout, gate) -> None:
    t = table(f"rollout · gate {gate or 'off'}", ("task", "type", "rewards", "cut", "d_K", "steps", "step-tokens", "time (s)"),
              left=("task", "type", "rewards"))
    for g in rollout.groups:
        d = g.signals.get(gate.K if gate else 10, {}).get("prefix_edit_distance_mean")
        t.add_row(g.game.game_id.split("/")[0][:40], g.game.task_type[:22], "".join(f"{r:.0f}" for r in g.rewards),
                  f"at {g.cut_step}" if g.cut else "", "" if d is None else f"{d:.3f}", str(g.env_steps),
                  str(g.step_tokens), f"{g.cost_s:.1f}")
    console.print(t)
    s = rollout.stats
    console.print(f"wall {s.wall_s:.1f}s (generate {s.generate_s:.1f}s, env {s.env_s:.1f}s) · {s.env_steps} env steps · "
                  f"{s.step_tokens} step-tokens · {sum(g.cut for g in rollout.groups)}/{len(rollout.groups)} groups cut")


def print_logprob_check(check, path) -> None:
    """`agentrl rollout --verify-logprobs`: the gap statistics, the tolerance and the verdict (a failure's one line goes to stderr)."""
    if not check.tokens:
        console.print(f"log-prob check: no action tokens in {check.trajectories} trajectories; wrote {path}")
        return
    bounds = ", ".join(f"{n} <= {b:g}" for n, b in check.tolerance.items())
    verdict = "[green]passed[/]" if check.passed else "[bold red]failed[/]"
    console.print(f"log-prob check ({check.precision}, {check.tokens:,} action tokens of {check.trajectories} trajectories): "
                  f"|sampler - learner| largest {check.max:.3g}, p99.9 {check.p99_9:.3g}, mean {check.mean:.3g}; "
                  f"tolerance {bounds}: {verdict}")
    console.print(f"wrote {path}")


# ---------------------------------------------------------------- train
SHORT_TYPE = dict(zip(TASK_TYPES, ("pick", "pick2", "clean", "heat", "cool", "look")))


def run_line(run, cfg) -> str:
    """What a training run is about to do, in one line."""
    return (f"run {run} · model {cfg.model.name}"
            f"{f' + {cfg.train.init_adapter}' if cfg.train.init_adapter else ''} · env {cfg.env.kind} · gate {cfg.rollout.gate} · "
            f"B={cfg.rollout.tasks} G={cfg.rollout.group_size} T_max={cfg.rollout.max_steps or cfg.env.max_steps} · "
            f"advantage {describe_advantage(cfg)} · {cfg.train.iterations} iterations · seed {cfg.seed}")


def describe_advantage(cfg) -> str:
    a = cfg.train.advantage
    if a == "gigpo":
        a += f" (gamma {cfg.advantage.gamma}, omega {cfg.advantage.omega}{'' if cfg.advantage.std_norm else ', no std'})"
    if cfg.reward.invalid_action:
        a += f" · invalid action {cfg.reward.invalid_action}" + (" (in the advantage)" if cfg.reward.invalid_action_in == "advantage" else "")
    a += " · cut replies masked" if cfg.advantage.mask_cut_replies else ""
    return a + (" · cut groups in N at A = 0" if cfg.advantage.cut_groups == "zero" else "")


def print_curve(rows: list[dict], where) -> None:
    """The learning curve of a run (its metrics rows): one row per iteration, held-out success where evaluated."""
    eval_rows = {r["iteration"]: r for r in rows if r["kind"] == "eval"}
    evals = {i: eval_text(r) for i, r in eval_rows.items()}
    base = next((r for r in reversed(rows) if r["kind"] == "base_eval"), None)
    t = table(f"learning curve · {where}", ("iter", "train reward (uncut)", "won (all)", "cut", "zero-var", "tokens gen/trained",
                                             "held-out [95% CI]"))
    if base is not None:
        t.add_row("base", "", "", "", "", "", eval_text(base))
    if 0 in evals:
        t.add_row("0", "", "", "", "", "", evals[0])
    for r in rows:
        if r["kind"] == "iteration":
            reward = "-" if r["train_reward"] is None else f"{r['train_reward']:.3f}"
            won = "-" if r.get("train_success") is None else f"{r['train_success']:.3f}"  # absent from runs before it
            t.add_row(str(r["iteration"]), reward, won, f"{r['groups_cut']}/{r['groups']}", str(r["zero_variance_groups"]),
                      f"{r['step_tokens_generated']}/{r['step_tokens_trained']}", evals.get(r["iteration"], ""))
    console.print(t)
    print_stage_totals([r for r in rows if r["kind"] == "iteration"])
    for line in (warm_start_verdict(base, list(eval_rows.values())), learning_verdict(list(eval_rows.values()))):
        if line:
            console.print(f"[bold]{line}[/]")


def print_stage_totals(rows: list[dict]) -> None:
    """Run totals: what was generated vs trained, and what each selection stage decided and kept out."""
    totals = run_totals(rows)
    if totals is None:
        return
    n = totals["tokens"]
    console.print(f"run totals: trajectories {n['trajectories_generated']} generated, {n['trajectories_trained']} "
                  f"trained; step-tokens {n['step_tokens_generated']} generated, {n['step_tokens_trained']} trained, "
                  f"{n['step_tokens_excluded_by_stages']} kept out by stages, {n['step_tokens_zero_advantage']} "
                  f"with zero advantage")
    a = totals["advantage"]
    if a is not None:
        console.print(f"advantage L2: {a['kept_l2']:.3f} over {a['kept_groups']} groups in the loss, {a['audited_l2']:.3f} over "
                      f"{a['audited_groups']} audited groups the gate would have cut; est. share dropped by the gate per "
                      f"iteration {100 * a['dropped_share_mean']:.1f}% (mean)")
    t = table("selection stages (run totals)", ("stage", "decisions", "tokens decided on", "kept out of loss", "avoided (est.)"),
              left=("stage", "decisions"))
    for name, s in totals["stages"].items():
        t.add_row(name, ", ".join(f"{k} {v}" for k, v in s["decisions"].items()),
                  *(str(s[k]) for k in ("step_tokens_generated", "step_tokens_excluded", "step_tokens_avoided")))
    console.print(t)


def phase_label(name: str, iteration: int, iterations: int) -> str:
    """A train phase's bar, named as metrics_line names its row: `eval base model`, `eval it 0`,
    `rollout it 1/2` (make train's log showed three bars called `eval`)."""
    if name == "base_eval":
        return "eval base model"
    return f"eval it {iteration}" if name == "eval" else f"{name} it {iteration}/{iterations}"


def metrics_line(row: dict, iterations: int) -> str:
    """One line per metrics row: what a user watches while the run goes."""
    if row["kind"] in ("eval", "base_eval"):
        types = "  ".join(f"{SHORT_TYPE.get(k, k)} {100 * v['success']:.0f}%" for k, v in row["by_task_type"].items())
        what = "base model" if row["kind"] == "base_eval" else f"it {row['iteration']:>3}"
        took = "cached" if row.get("cached") else f"{row['eval_s']:.1f}s"
        return (f"[bold cyan]eval[/] {what}  held-out success [bold]{eval_text(row)}[/] "
                f"({row['split']}, 95% Wilson)  {types}  {behaviour(row)}  {took}")

    return (f"it {row['iteration']:>3}/{iterations}  reward {num(row['train_reward'], '.3f')}  "
            + (f"won {num(row['train_success'], '.3f')}  " if row.get("train_success") is not None else "")
            + 
            f"groups {row['groups']} cut {row['groups_cut']} zero-var {row['zero_variance_groups']}  "
            f"loss {row['loss']:+.4f}  |g| {row['grad_l2_norm']:.3f}  tokens {row['step_tokens_generated']}/{row['step_tokens_trained']} gen/trained  "
            f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s swap {row['swap_s']:.2f}s"
            + (f" eval {row['eval_s']:.1f}s" if row["eval_s"] > 0.01 else "") + f"  v{row['adapter_version']}  {behaviour(row)}"
            + stage_notes(row) + learner_notes(row))


def learner_notes(row: dict) -> str:
    """Over several optimizer steps the steps' mean loss and |g| (and the largest |g|: the line's own
    are the first step's); the KL penalty (and its coefficient in the field's unit: per action token)
    and the success replay."""
    out = ""
    if (row.get("optimizer_steps") or 0) > 1 and row.get("grad_l2_norm_mean") is not None:
        out += (f"  {row['optimizer_steps']} steps: loss mean {row['loss_mean']:+.4f} |g| mean "
                f"{row['grad_l2_norm_mean']:.3f} max {row['grad_l2_norm_max']:.3f}")
    if row.get("kl_coef_field") is not None:
        out += f"  KL {num(row.get('kl_to_warm_start'), '.4f')} (beta {row['kl_coef_field']:.3g} per token)"
    if row.get("replay_buffer") is not None:
        out += f"  replay nll {num(row.get('replay_nll'), '.3f')} buffer {row['replay_buffer']}"
    return out


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


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def behaviour(row: dict) -> str:
    """valid-action rate, reply length, episode length, looped share, the share whose first take was
    another object than the task's, and the loop guard's share of steps (where it acted) of a metrics row."""
    rate = row.get("valid_action_rate")
    cut = row.get("replies_cut_rate")
    return (f"valid {'-' if rate is None else f'{100 * rate:.0f}%'}  reply {num(row.get('mean_reply_tokens'), '.1f')} tok"
            f"{'' if not cut else f' ({100 * cut:.0f}% cut at max_new_tokens)'}  "
            f"episode {num(row.get('mean_episode_steps'), '.1f')} steps"
            + ("" if row.get("looped_rate") is None else f"  looped {pct(row['looped_rate'])}")
            + ("" if row.get("other_object_rate") is None else f"  other object {pct(row['other_object_rate'])}")
            + ("" if not row.get("guarded_rate") else f"  guarded {pct(row['guarded_rate'])}"))


def sft_epoch_line(row: dict) -> str:
    held = f"{row['heldout_nll']:.3f}" if row.get("heldout_nll") is not None else "-"
    train = f"{row['train_nll']:.3f}" if row.get("train_nll") is not None else "-"
    return f"epoch {row['epoch']}  train nll {train}  held-out nll {held}  {row['elapsed_s']:.0f}s"


def sft_summary_lines(summary: dict, out) -> list[str]:
    s = summary["sft"]
    expert = s.get("expert") == "handcoded"
    what = (f"the {s['won']} won of {s['trajectories']} rollouts" if "from" in s
            else f"the hand-coded expert's play of {s['examples']} games" if expert else f"{s['examples']} walkthroughs")
    if "from" in s and s.get("walkthroughs"):
        what += f" and {s['walkthroughs']} walkthroughs"
    if "dagger" in s:  # the aggregated data: walkthroughs, then the policy's states the planner labelled
        d = s["dagger"]
        what = (f"{s['examples'] - d['states']} walkthroughs and {d['states']} states of {d['trajectories']} rollouts "
                f"labelled by the planner ({d['labelled']} rollouts left its plan; {d['skipped']} skipped)")
    elif s.get("skipped") and "from" not in s:
        why = "the expert did not win them" if expert else "no winning walkthrough"
        what += f" ({s['skipped']} of {s['games']} skipped: {why})"
    if "decoys" in s:  # sft.decoys: visits played before the object's receptacle, not taught
        d = s["decoys"]
        what += f", {d['visits']} decoy visits in {d['decoyed']} of them ({d['plain']} as walked)"
    if s.get("init_adapter"):
        what += f", from {s['init_adapter']}"
    weights = f"LoRA r{summary['lora']['r']}" if summary["lora"]["r"] else "every weight (full fine-tuning)"
    return [f"wrote {out}: {weights} on {what} ({s['reply_tokens']} reply tokens), "
            f"{s['epochs']} epochs, {summary['minutes']:.1f} min; held-out NLL "
            f"{summary['heldout_nll']['before'] or float('nan'):.3f} -> {summary['heldout_nll']['after'] or float('nan'):.3f}",
            f"next: agentrl eval --adapter {out}   or   agentrl train --init-adapter {out}"]


# ---------------------------------------------------------------- analyze, report, compare
def print_analysis(a, groups_csv, out, precision_floor: float) -> None:
    t = table(f"signals vs learning signal · {groups_csv}", ("K", "groups running", "informative", "AUROC d_K", "ρ d_K",
              "best other signal (AUROC)"), left=("best other signal (AUROC)",))
    for c in signal_choice(a.correlation, a.by_type):
        t.add_row(str(c["K"]), str(c["groups"]), str(c["informative"]), f"{c['auroc']:.3f}", f"{c['spearman_rho']:.3f}",
                  f"{c['best_other'][0]} ({c['best_other'][1]:.3f})" if c["best_other"] else "")
    console.print(t)
    print_signal_table(a.signals, precision_floor)
    if a.operating:
        o = a.operating
        console.print(f"operating point (precision >= {precision_floor:g}): K={o['K']}, d_L={o['d_L']:g}: cut {o['cut']}/{o['N']}, "
                      f"precision {o['precision']:.2f}, recall {o['recall']:.2f}, safe saving {o['safe_pct']:.1f}% "
                      f"(raw {o['raw_pct']:.1f}%"
                      + (f"; step-tokens {o['tokens_pct']:.1f}%" if o["tokens_pct"] == o["tokens_pct"] else "")
                      + f"), advantage norm kept {o['adv_l2_kept']:.3f}"
                      + (f" (GiGPO's: {o['gigpo_l2_kept']:.3f})" if o["gigpo_l2_kept"] == o["gigpo_l2_kept"] else ""))
    else:
        console.print(f"no (K, d_L) on the grid reaches precision {precision_floor:g}")
    console.print(f"wrote correlation.csv, signals.csv, gate_sweep.csv, calibration.csv, by_task_type.csv, bootstrap.csv, "
                  f"operating_point.json and {len(a.figures)} figures to {out}")


def print_signal_table(rows: list[dict], precision_floor: float) -> None:
    """Per K and signal: AUROC [95% bootstrap] (informative vs zero-variance; > 0.5 predicts), the same
    against all-fail and all-success groups only, the best cut at the precision floor (its saving by the
    paper's formula, and in step-tokens where the table has its trajectories), and the highest precision
    of a cut that removes at least half of the all-fail groups (issue 49's target). Then the oracle's
    saving per K: every zero-variance group still running at K cut, the bound on any gate there."""
    short = {v: k for k, v in _SHORT.items()} | {"or_rule": "d_k OR tau"}

    def f(v, fmt=".2f"):
        return "-" if v != v else format(v, fmt)

    t = table(f"which signal predicts a zero-variance group (AUROC > 0.5 predicts; best cut at precision >= {precision_floor:g})",
              ("K", "signal", "AUROC [95% CI]", "vs all-fail", "vs all-success", "best cut", "precision", "safe saving",
               "precision at all-fail recall 0.5"),
              left=("signal", "best cut"))
    measured = any(r.get("best_tokens_pct", float("nan")) == r.get("best_tokens_pct", float("nan")) for r in rows)
    for r in rows:
        t.add_row(str(r["K"]), short.get(r["signal"], r["signal"]),
                  f"{f(r['auroc'])} [{f(r['auroc_ci95_low'])}, {f(r['auroc_ci95_high'])}]" if r["auroc"] == r["auroc"] else "-",
                  f(r["auroc_vs_all_fail"]), f(r["auroc_vs_all_success"]),
                  (f"{r['best_cut']} (fixed)" if r["best_threshold"] == "fixed" else f"{r['best_cut']} at {r['best_threshold']}")
                  if r["best_cut"] else "none", f(r["best_precision"]),
                  f"{r['best_safe_pct']:.1f}%" + (f" ({r['best_tokens_pct']:.1f}% tok)" if measured else ""),
                  f(r["all_fail_r50_precision"]))
    console.print(t)
    oracle = {r["K"]: r for r in rows if "oracle_safe_pct" in r}
    if oracle:
        console.print("the oracle (every zero-variance group still running at K cut): " + ", ".join(
            f"K {K} {r['oracle_safe_pct']:.1f}%" + (f" ({r['oracle_tokens_pct']:.1f}% of step-tokens)" if measured else "")
            + f" of {r['running']}/{r['N']} running" for K, r in sorted(oracle.items())))


def print_report_tables(tables) -> None:
    """(title, header, rows) tables of `agentrl report`; a wide one turned to one row per metric."""
    for title, header, rows in tables:
        if len(header) > 7:  # one row per metric, one column per run: fits a terminal
            header, rows = transposed(header, rows)
        t = table(title, header, left=header[:1])
        for row in rows:
            t.add_row(*row)
        console.print(t)


def print_comparison(r: dict, a: list, b: list) -> None:
    def pooled(side: list) -> str:
        return f" (mean of {len(side)} evals per game)" if len(side) > 1 else ""

    mcnemar = r["overall"]["test"] == "exact McNemar"  # 0/1 outcomes; shares get the sign test
    t = table(f"A = {r['a']}{pooled(a)}  ·  B = {r['b']}{pooled(b)}", ("games", "A won", "A 95% CI", "B won", "B 95% CI", "B - A", *(
              ("only A", "only B", "McNemar p") if mcnemar else ("A better", "B better", "sign test p"))), left=("games",))

    def ci(c) -> str:
        return "-" if c is None else f"{100 * c[0]:.1f}–{100 * c[1]:.1f}%"

    sections = [r["by_task_type"], r.get("by_split", {}), {"overall": r["overall"]}]
    for section in filter(None, sections):  # a rule between task types, splits and overall
        t.add_section()
        for name, x in section.items():
            t.add_row(f"{name} ({x['games']})", f"{100 * x['success_a']:.1f}%", ci(x["ci95_a"]), f"{100 * x['success_b']:.1f}%",
                      ci(x["ci95_b"]), f"{x['difference_points']:+.1f}", str(len(x["won_only_by_a"])),
                      str(len(x["won_only_by_b"])), f"{x['mcnemar_p']:.3g}", style="bold" if name == "overall" else None)
    console.print(t)
    o = r["overall"]
    if o["only_in_a"] or o["only_in_b"]:
        err.print(f"[yellow]compared the {o['games']} games both ran; {o['only_in_a']} only in A and {o['only_in_b']} only in B left out")
    if "numerics" in r:
        n = r["numerics"]
        err.print(f"[yellow]A ran at {', '.join(n['a'])}, B at {', '.join(n['b'])}: part of the difference may be the "
                  "numerics, not the policy (summary.json's machine)")
    if "by_seed" in r:
        print_seed_pairs(r["by_seed"])


def print_seed_pairs(s: dict) -> None:
    """`compare A0 A1 vs B0 B1`: each seed's pair, then the mean over seeds with its t interval."""
    t = table("seed by seed (A's eval i against B's eval i)", ("pair", "games", "A won", "B won", "B - A", "only A",
                                                              "only B", "McNemar p"), left=("pair",))
    for p in s["pairs"]:
        t.add_row(f"{p['a']} → {p['b']}", str(p["games"]), str(p["won_a"]), str(p["won_b"]),
                  f"{p['difference_points']:+.1f}", str(p["won_only_by_a"]), str(p["won_only_by_b"]), f"{p['mcnemar_p']:.3g}")
    d = s["difference_points"]
    lo, hi = d["ci95"]
    t.add_row(f"mean of {d['seeds']} (t interval)", "", "", "", f"{d['mean']:+.1f} [{lo:+.1f}, {hi:+.1f}]", "", "", "",
              style="bold")
    console.print(t)


# ---------------------------------------------------------------- doctor, data
def print_checks(checks) -> None:
    t = table("agentrl doctor", ("", "what", "found", "to fix"), left=True)
    mark = {"ok": "[green]✓", "warn": "[yellow]![/]", "missing": "[red]✗"}
    for c in checks:
        t.add_row(mark[c.status], escape(c.what), escape(c.detail), escape(c.fix))
    console.print(t)
    missing = [c.what for c in checks if c.status == "missing"]
    console.print("everything the CPU path needs is here" if not any(
        c.status == "missing" and not c.what.startswith("vLLM") for c in checks) else f"missing: {', '.join(missing)}")


def print_games(root, splits, scans: dict, playable: dict | None = None) -> None:
    """Games per split (columns) and task type (rows) of `agentrl data check`; corrupt files, missing
    splits; per split, what the replay cache knows of its walkthroughs (won, not won, not replayed)."""
    t = table(f"ALFWorld games in {root}", ("task type", *splits), left=("task type",))
    for kind in TASK_TYPES + ("all",):
        cells = ["missing" if s not in scans else str(len(scans[s].games) if kind == "all" else
                 sum(g.task_type == kind for g in scans[s].games)) for s in splits]
        t.add_row(kind, *cells, style="bold" if kind == "all" else None)
    console.print(t)
    for s, scan in scans.items():
        for path, why in scan.corrupt:
            err.print(f"[yellow]corrupt ({s}): {path}: {why}")
        if scan.unsolvable:
            console.print(f"{s}: {len(scan.unsolvable)} unsolvable games skipped")
    for s, (won, unwinnable, unknown) in (playable or {}).items():
        console.print(f"{s}: {won} playable (their walkthrough wins), {unwinnable} whose walkthrough does not win "
                      f"(agentrl sft skips them), {unknown} not replayed yet"
                      + (f" (`agentrl data replay --split {s}` replays them)" if unknown else ""))
    if len(scans) < len(splits):
        err.print(f"[yellow]missing splits: {', '.join(s for s in splits if s not in scans)}")


def replay_lines(split: str, stats, workers: int | None, where, failed: list[tuple[str, str]],
                 unwinnable: list[str] = ()) -> list[str]:
    """`agentrl data replay`: what was replayed, how fast, what won; the failures by game (a few)."""
    how = ("no env opened" if workers is None else "in this process" if workers == 0
           else f"{workers} env worker{'s' if workers != 1 else ''}")
    lines = [f"{stats.games} {split} walkthroughs: {stats.hits} from the cache, {stats.replayed} replayed ({how}) "
             f"in {stats.seconds:.1f}s; {stats.won} won, {stats.unwinnable} unwinnable, {stats.failed} failed"
             + (f"; {stats.corrupt} damaged cache files rebuilt" if stats.corrupt else ""),
             f"playable: {stats.won} of {stats.games}" + (f"; {stats.unwinnable} whose walkthrough does not win are "
                                                          "skipped by agentrl sft" if stats.unwinnable else ""),
             f"replay cache: {where}"]
    lines += [f"  does not win {escape(g)}" for g in unwinnable[:5]]
    if len(unwinnable) > 5:
        lines.append(f"  ... and {len(unwinnable) - 5} more")
    lines += [f"  failed {escape(g)}: {escape(why)}" for g, why in failed[:5]]
    if len(failed) > 5:
        lines.append(f"  ... and {len(failed) - 5} more")
    return lines
