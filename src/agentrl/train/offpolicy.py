"""Tier 2 of the paper: the off-policy A/B on a frozen rollout buffer (Table 4 analogue).

A buffer written by `agentrl rollout` (trajectories.jsonl, and groups.csv beside it) is replayed
through the learner twice, from the same base model, the same LoRA initialisation (cfg.seed)
and the same seeded plan: per step, `groups_per_step` groups drawn uniformly without
replacement, and per trajectory up to `positions` sampled action positions (one position =
one reply = one maximal run of action_mask == 1). The baseline arm trains on every planned
group; the gated arm drops the groups whose recorded signals at K make the gate's rule fire
(d_K < d_L, strictly, as `select.gate_rule.Threshold.fires`). What differs between the arms is only the gate, so
the wall-clock, item and gradient-norm differences are its effect on the learner.

Each trajectory enters the learner as a light view: its token ids cut right after its last
sampled position (later tokens cannot influence earlier log-probs, so this only saves
compute), the action mask kept on the sampled positions only, the sampler log-probs alongside.
One optimizer step per planned step, `Learner.update` on all views of the kept groups.
"""

from __future__ import annotations

import csv
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agentrl.errors import UserError
from agentrl.io import read_jsonl_numbered
from agentrl.models import load_model
from agentrl.rollout.signals import SIGNALS, Trace, reply_logprobs, signals_at
from agentrl.rollout.trajectory import GroupOutcome
from agentrl.rollout.signals import command_symbol as action_symbol  # the same symbols as the rollout
from agentrl.select.cut import gate_rule
from agentrl.select.gate_rule import GateRule
from agentrl.specs import GateSpec, parse_gate
from agentrl.train.advantage import group_advantages
from agentrl.train.learner import build_learner
from agentrl.train.loss import token_logprobs

ARMS = ("baseline", "gated")
D_K = "prefix_edit_distance_mean"
REQUIRED_KEYS = ("task_id", "reward", "token_ids", "action_mask")


# ---------------------------------------------------------------- the buffer
@dataclass
class BufferTrajectory:
    """One recorded trajectory; `token_ids`/`action_mask`/`logprobs` as the sampler produced them."""

    task_id: str
    index: int
    reward: float
    token_ids: list[int]
    action_mask: list[int]
    logprobs: list[float]
    symbols: list[str] | None = None  # one action symbol per env step (None: no step records)
    observations: list[str] = field(default_factory=list)  # o after each step
    initial_observation: str = ""
    stop_reason: str | None = None
    allowed: list[list[int]] = field(default_factory=list)  # admissible actions: per action token, the ids it was drawn among
    reply_starts: list[int] | None = None  # where each reply begins (None: a record without them; `spans` then)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return action_spans(self.action_mask)

    def trace(self) -> Trace:
        """What the signals read of it (needs step records: `symbols` not None)."""
        return Trace(self.symbols, self.observations, self.initial_observation, self.stop_reason,
                     reply_logprobs(self.logprobs, self.action_mask,
                                    self.reply_starts if self.reply_starts is not None else [a for a, _ in self.spans]))


@dataclass
class BufferGroup(GroupOutcome):
    """The G trajectories of one task, with the signals `agentrl rollout` recorded per K."""

    task_id: str
    trajectories: list[BufferTrajectory]
    recorded: dict[int, dict[str, float]] = field(default_factory=dict)  # K -> signals read from groups.csv
    _computed: dict[int, dict[str, float]] = field(default_factory=dict, repr=False)

    def signals_at(self, K: int) -> dict[str, float]:
        """The signals at step K: groups.csv's values, the rest computed from the step records
        by the rollout's own definition (`rollout.signals.signals_at`) when the records have them."""
        row = self.recorded.get(K, {})
        if all(name in row for name in SIGNALS):
            return dict(row)
        if K not in self._computed:
            trajs = self.trajectories
            if any(t.symbols is None for t in trajs):
                if D_K in row:
                    return dict(row)
                raise UserError(f"task {self.task_id}: no groups.csv row for K={K} and no step_records to compute d_K from")
            self._computed[K] = signals_at([t.trace() for t in trajs], K)
        return self._computed[K] | row

    def d_K(self, K: int) -> float:
        return self.signals_at(K)[D_K]

    def gate_fires(self, rule: GateRule) -> bool:
        """The gate's rule on the recorded signals at its K (d_K < d_L, strictly; plus the OR-rule if set)."""
        try:
            return rule.fires(self.signals_at(rule.K))
        except KeyError as e:  # groups.csv lacks a signal the rule reads (e.g. the OR-rule's)
            raise UserError(f"task {self.task_id}: the gate {rule} needs {e.args[0]} at K={rule.K} "
                            "(not in groups.csv, no step_records)") from None


class Buffer(list):
    """A list of BufferGroup that also says where it came from and what was skipped."""

    def __init__(self, groups=(), path: Path | None = None, skipped_cut: int = 0, has_groups_csv: bool = False):
        super().__init__(groups)
        self.path, self.skipped_cut, self.has_groups_csv = path, skipped_cut, has_groups_csv


def _read_groups_csv(path: Path) -> dict[tuple[str, int], dict[str, float]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        missing = [c for c in ("task_id", "K", D_K) if c not in cols]
        if missing:
            raise UserError(f"{path}: missing columns {', '.join(missing)}")
        present = [s for s in SIGNALS if s in cols]
        rows: dict[tuple[str, int], dict[str, float]] = {}
        for line, row in enumerate(reader, start=2):
            try:
                key = (row["task_id"], int(row["K"]))
                values = {s: float(row[s]) for s in present}
            except (TypeError, ValueError) as e:
                raise UserError(f"{path}:{line}: bad value ({e})") from None
            if key in rows:
                raise UserError(f"{path}:{line}: task {key[0]} has a second row for K={key[1]}")
            rows[key] = values
    return rows


def _trajectory(rec: dict, where: str) -> BufferTrajectory:
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)} (is this trajectories.jsonl from `agentrl rollout`?)")
    ids, mask = rec["token_ids"], rec["action_mask"]
    logprobs = rec.get("logprobs") or [0.0] * len(ids)
    if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(logprobs, list)):
        raise UserError(f"{where}: token_ids, action_mask and logprobs must be lists")
    if not (len(ids) == len(mask) == len(logprobs)):
        raise UserError(f"{where}: token_ids ({len(ids)}), action_mask ({len(mask)}) and logprobs "
                        f"({len(logprobs)}) differ in length")
    if not ids:
        raise UserError(f"{where}: empty token_ids")
    steps = rec.get("step_records")
    symbols = observations = None
    if isinstance(steps, list):
        symbols = [action_symbol(s.get("command"), s.get("action")) for s in steps]
        observations = [str(s.get("observation", "")) for s in steps]
    try:
        return BufferTrajectory(
            task_id=str(rec["task_id"]), index=int(rec.get("trajectory", 0)), reward=float(rec["reward"]),
            token_ids=[int(x) for x in ids], action_mask=[1 if int(m) else 0 for m in mask],
            logprobs=[float(x) for x in logprobs], symbols=symbols, observations=observations or [],
            initial_observation=str(rec.get("initial_observation", "")), stop_reason=rec.get("stop_reason"),
            allowed=[[int(x) for x in a] for a in rec.get("allowed") or []],
            reply_starts=[int(x) for x in rec["reply_starts"]] if isinstance(rec.get("reply_starts"), list) else None,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: bad value ({e})") from None


def load_buffer(path: Path) -> Buffer:
    """Read a frozen buffer (trajectories.jsonl from `agentrl rollout`, or its directory) into groups.

    Records are grouped by task_id in file order. Signals come from groups.csv beside the file when
    it has them, else they are computed from the step records as the rollout computed them. Groups
    the rollout already cut cannot serve the A/B (the baseline arm needs their full trajectories):
    they are skipped and counted in `skipped_cut`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "trajectories.jsonl"
    if not path.is_file():
        raise UserError(f"buffer not found: {path} (expected trajectories.jsonl from `agentrl rollout`)")
    by_task: dict[str, list[BufferTrajectory]] = {}
    cut: dict[str, bool] = {}
    for line_no, rec in read_jsonl_numbered(path, bad="not a JSON line (expected trajectories.jsonl from `agentrl rollout`)"):
        where = f"{path}:{line_no}"
        if not isinstance(rec, dict):
            raise UserError(f"{where}: not a JSON object")
        t = _trajectory(rec, where)
        group = by_task.setdefault(t.task_id, [])
        if any(o.index == t.index for o in group):
            raise UserError(f"{where}: task {t.task_id} has trajectory {t.index} twice (two buffers concatenated?)")
        group.append(t)
        cut[t.task_id] = cut.get(t.task_id, False) or bool(rec.get("group_cut", False))
    if not by_task:
        raise UserError(f"{path}: no trajectories")
    for task_id, trajs in by_task.items():
        if len(trajs) < 2:
            raise UserError(f"{path}: task {task_id} has {len(trajs)} trajectory; a group needs at least 2")
    csv_path = path.parent / "groups.csv"
    recorded = _read_groups_csv(csv_path) if csv_path.is_file() else {}
    groups = [
        BufferGroup(task_id, trajs, {K: v for (tid, K), v in recorded.items() if tid == task_id})
        for task_id, trajs in by_task.items() if not cut[task_id]
    ]
    skipped = sum(cut.values())
    if not groups:
        raise UserError(f"{path}: all {skipped} groups were cut during the rollout; roll out with --gate off for an A/B buffer")
    return Buffer(groups, path=path, skipped_cut=skipped, has_groups_csv=csv_path.is_file())


# ---------------------------------------------------------------- positions and views
def action_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of action_mask == 1 as [start, end) pairs: one per reply."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


@dataclass
class TrainView:
    """What the learner trains on: a prefix of a trajectory with only the sampled positions masked in."""

    task_id: str
    index: int
    token_ids: list[int]
    action_mask: list[int]
    logprobs: list[float]
    positions: list[int]  # indices into the trajectory's action spans
    allowed: list[list[int]] = field(default_factory=list)  # the sampled spans' allowed ids (admissible actions)

    @property
    def items(self) -> int:
        return len(self.positions)


def make_view(traj: BufferTrajectory, positions: Sequence[int]) -> TrainView:
    """Truncate right after the last sampled span; keep the mask on the sampled spans only."""
    spans = traj.spans
    chosen = sorted(positions)
    end = spans[chosen[-1]][1] if chosen else 0
    mask = [0] * end
    for p in chosen:
        s, e = spans[p]
        mask[s:e] = [1] * (e - s)
    allowed = []
    if traj.allowed:  # per action token in order: span p's are those after the spans before it
        offsets = [0]
        for s, e in spans:
            offsets.append(offsets[-1] + e - s)
        allowed = [a for p in chosen for a in traj.allowed[offsets[p] : offsets[p + 1]]]
    return TrainView(traj.task_id, traj.index, traj.token_ids[:end], mask, traj.logprobs[:end], chosen, allowed)


@dataclass
class StepPlan:
    groups: list[int]  # buffer indices, in draw order
    positions: list[list[list[int]]]  # [group][trajectory] -> sampled span indices, sorted


def plan_steps(buffer: Sequence[BufferGroup], steps: int, groups_per_step: int, positions: int, seed: int) -> list[StepPlan]:
    """The seeded plan both arms follow: groups per step (uniform, no replacement within a step),
    then up to `positions` action positions per trajectory (uniform, no replacement)."""
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(steps):
        idx = [int(i) for i in rng.choice(len(buffer), size=groups_per_step, replace=False)]
        pos = []
        for i in idx:
            per_traj = []
            for t in buffer[i].trajectories:
                n = len(t.spans)
                per_traj.append(sorted(int(p) for p in rng.choice(n, size=min(positions, n), replace=False)) if n else [])
            pos.append(per_traj)
        plan.append(StepPlan(idx, pos))
    return plan


def build_batch(buffer: Sequence[BufferGroup], step: StepPlan, cut: Sequence[bool], estimator: str = "grpo"):
    """([(view, advantage), ...], kept group indices, cut group indices) of one planned step.

    Advantages come from the whole group's rewards (all G trajectories), as on-policy; a trajectory
    with no action position (e.g. an env error before its first reply) adds no view.
    """
    batch, kept, dropped = [], [], []
    for gi, per_traj in zip(step.groups, step.positions):
        if cut[gi]:
            dropped.append(gi)
            continue
        kept.append(gi)
        group = buffer[gi]
        adv = group_advantages(group.rewards, estimator).tolist()
        for t, a, pos in zip(group.trajectories, adv, per_traj):
            if pos:
                batch.append((make_view(t, pos), float(a)))
    return batch, kept, dropped


# ---------------------------------------------------------------- the A/B
def _default_loader(cfg) -> Callable[[], object]:
    def load():
        return load_model(cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)[0]

    return load


def _sync(device) -> None:
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(learner, view: TrainView) -> None:
    """One forward/backward without an optimizer step, so one-off start-up cost (kernels, allocator)
    lands in neither arm's timing. The weights and the optimizer state do not change."""
    learner.model.train()
    ids = torch.tensor([view.token_ids], device=learner.device)
    logp = token_logprobs(learner.model, ids, torch.ones_like(ids))
    (logp * torch.tensor([view.action_mask], device=learner.device)).sum().backward()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.model.eval()
    _sync(learner.device)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _run_arm(name, learner, buffer, plan, cut, estimator, progress) -> dict:
    per_step = []
    for s, step in enumerate(plan):
        batch, kept, dropped = build_batch(buffer, step, cut, estimator)
        stats = None
        elapsed = 0.0
        if batch:
            t0 = time.perf_counter()
            stats = learner.update(batch)
            _sync(learner.device)
            elapsed = time.perf_counter() - t0
        row = {
            "step": s + 1,
            "sampled": [buffer[i].task_id for i in step.groups],
            "cut": [buffer[i].task_id for i in dropped],
            "groups_used": len(kept),
            "trajectories": len(batch),
            "items": sum(v.items for v, _ in batch),
            "action_tokens": sum(sum(v.action_mask) for v, _ in batch),
            "forward_tokens": sum(len(v.token_ids) for v, a in batch if a != 0.0),
            "wall_s": elapsed,
            "stepped": bool(stats and stats.stepped),
            "skipped": bool(stats and stats.skipped),
            "loss": stats.loss if stats else None,
            "grad_l2_norm": stats.grad_l2_norm if stats else None,
            "tokens_trained": stats.step_tokens_trained if stats else 0,
            "logprob_gap": stats.logprob_gap if stats else None,
        }
        per_step.append(row)
        if progress:
            progress(name, s + 1, len(plan), row)
    stepped = [r for r in per_step if r["stepped"]]
    return {
        "wall_s": float(sum(r["wall_s"] for r in per_step)),
        "items": sum(r["items"] for r in per_step),
        "groups_used": sum(r["groups_used"] for r in per_step),
        "groups_cut": sum(len(r["cut"]) for r in per_step),
        "trajectories": sum(r["trajectories"] for r in per_step),
        "action_tokens": sum(r["action_tokens"] for r in per_step),
        "tokens_trained": sum(r["tokens_trained"] for r in per_step),
        "forward_tokens": sum(r["forward_tokens"] for r in per_step),
        "steps_stepped": len(stepped),
        "steps_skipped": sum(r["skipped"] for r in per_step),
        "grad_norm_mean": _mean(r["grad_l2_norm"] for r in stepped),
        "loss_mean": _mean(r["loss"] for r in stepped),
        "logprob_gap_mean": _mean(r["logprob_gap"] for r in stepped),
        "per_step": per_step,
    }


def _pct(new, old) -> float | None:
    return 100.0 * (new / old - 1.0) if old else None


def _check_ab(cfg, buffer: Sequence[BufferGroup], steps: int, groups_per_step: int, positions: int,
              gate: GateSpec | None, arms: Sequence[str]) -> None:
    """One-line errors for an A/B the buffer, the gate or the settings cannot serve."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or len(set(arms)) != len(arms):
        raise UserError(f"arms must be distinct names from {', '.join(ARMS)}, got {', '.join(arms) or 'none'}")
    if gate is not None and gate.auto:
        raise UserError("Tier 2 replays the recorded d_K with a fixed threshold: give --gate K,d_L (K,auto is for "
                        "train, rollout and Tier 1; `agentrl analyze` finds a d_L offline)")
    if gate is None and "gated" in arms:
        raise UserError("--ab needs a gate (--gate K,d_L); the gated arm drops groups by the recorded d_K")
    for ok, message in [
        (steps >= 1, f"--steps must be >= 1, got {steps}"),
        (groups_per_step >= 1, f"--groups-per-step must be >= 1, got {groups_per_step}"),
        (positions >= 1, f"--positions must be >= 1, got {positions}"),
        (len(buffer) >= 1, "the buffer has no usable groups"),
        (groups_per_step <= len(buffer),
         f"--groups-per-step {groups_per_step} exceeds the buffer's {len(buffer)} usable groups"),
        (cfg.train.advantage != "gigpo", "Tier 2 trains sampled action positions of a frozen buffer, one advantage per "
                                         "trajectory: --advantage gigpo is for on-policy `agentrl train`"),
    ]:
        if not ok:
            raise UserError(message)


def run_offpolicy_ab(
    cfg,
    buffer: Sequence[BufferGroup],
    steps: int,
    groups_per_step: int,
    positions: int,
    gate: GateSpec | str | None,
    arms: Sequence[str] = ARMS,
    model_loader: Callable[[], object] | None = None,
    progress: Callable[[str, int, int, dict], None] | None = None,
) -> dict:
    """Replay the buffer through a fresh learner per arm (same base, same seed, same plan); Table 4 numbers.

    `progress(arm, step, steps, row)` is called after every step. Arms run one after the other;
    each arm's model is released before the next loads.
    """
    gate = parse_gate(gate) if isinstance(gate, str) else gate
    _check_ab(cfg, buffer, steps, groups_per_step, positions, gate, arms)
    rule = gate_rule(gate) if gate is not None else None
    fires = [g.gate_fires(rule) for g in buffer] if rule is not None else [False] * len(buffer)
    plan = plan_steps(buffer, steps, groups_per_step, positions, cfg.seed)
    loader = model_loader or _default_loader(cfg)
    estimator = cfg.train.advantage
    first = next((v for step in plan for v, _ in build_batch(buffer, step, [False] * len(buffer), estimator)[0]), None)

    results = {}
    for name in arms:
        learner = build_learner(cfg, loader(), warm_start=False)  # each arm from the base model's fresh LoRA
        if first is not None:
            _warm_up(learner, first)
        cut = fires if name == "gated" else [False] * len(buffer)
        results[name] = _run_arm(name, learner, buffer, plan, cut, estimator, progress)
        del learner
        gc.collect()
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - best effort
            pass

    change = {}
    if "baseline" in results and "gated" in results:
        b, g = results["baseline"], results["gated"]
        change = {
            "wall_s_pct": _pct(g["wall_s"], b["wall_s"]),
            "items_pct": _pct(g["items"], b["items"]),
            "groups_cut": g["groups_cut"] - b["groups_cut"],
            "grad_norm_ratio": g["grad_norm_mean"] / b["grad_norm_mean"]
            if g["grad_norm_mean"] is not None and b["grad_norm_mean"] else None,
        }
    return {
        "gate": str(gate) if gate is not None else "off",
        "steps": steps, "groups_per_step": groups_per_step, "positions": positions, "seed": cfg.seed,
        "advantage": estimator,
        "buffer": {
            "path": str(getattr(buffer, "path", "") or ""),
            "groups": len(buffer),
            "trajectories": sum(len(g.trajectories) for g in buffer),
            "skipped_cut": getattr(buffer, "skipped_cut", 0),
            "zero_variance": sum(g.zero_variance for g in buffer),
            "below_gate": sum(fires),
            "below_gate_zero_variance": sum(f and g.zero_variance for f, g in zip(fires, buffer)),
        },
        "arms": results,
        "change": change,
    }


def offpolicy_markdown(report: dict) -> str:
    """The Table 4 analogue: the learner-side cost and gradient signal of the two arms."""
    arms, c = report["arms"], report.get("change") or {}
    names = [a for a in ARMS if a in arms]

    def cells(key, fmt):
        return " | ".join("n/a" if arms[a][key] is None else fmt(arms[a][key]) for a in names)

    def pct(x):
        return "" if x is None else f"{x:+.1f}%"

    ratio = c.get("grad_norm_ratio")
    buf = report["buffer"]
    lines = [
        f"# Tier 2 off-policy A/B: gate {report['gate']}, {report['steps']} steps x {report['groups_per_step']} groups, "
        f"{report['positions']} positions per trajectory, seed {report['seed']}",
        "",
        f"| | {' | '.join(names)} | change |",
        f"| --- |{' ---: |' * len(names)} ---: |",
        f"| total step wall-clock (s) | {cells('wall_s', lambda x: f'{x:.2f}')} | {pct(c.get('wall_s_pct'))} |",
        f"| train items | {cells('items', str)} | {pct(c.get('items_pct'))} |",
        f"| groups cut | {cells('groups_cut', str)} | |",
        f"| mean gradient L2 norm | {cells('grad_norm_mean', lambda x: f'{x:.4g}')} | "
        f"{'' if ratio is None else f'x{ratio:.2f}'} |",
        "",
        f"Buffer: {buf['groups']} usable groups, {buf['trajectories']} trajectories"
        + (f" ({buf['skipped_cut']} group(s) cut during the rollout skipped)" if buf["skipped_cut"] else "")
        + f"; {buf['zero_variance']} zero-variance; the gate fires on {buf['below_gate']} "
        f"({buf['below_gate_zero_variance']} of them zero-variance).",
        "Groups used per arm: " + ", ".join(f"{a} {arms[a]['groups_used']}" for a in names)
        + "; optimizer steps: " + ", ".join(f"{a} {arms[a]['steps_stepped']}/{report['steps']}" for a in names)
        + "; tokens through forward/backward (A != 0): " + ", ".join(f"{a} {arms[a]['forward_tokens']}" for a in names)
        + ". A train item is one (trajectory, action position); wall-clock sums the learner updates only, and "
        "items with A = 0 (zero-variance groups) cost no compute in either arm.",
        "",
    ]
    return "\n".join(lines)
