"""`agentrl rollout --verify-logprobs`: the sampler's log-probs against the learner's.

Every trajectory a rollout wrote is teacher-forced through the learner's own log-prob path
(`LocalLearner.logprobs`: the update's pre-pass, with its micro-batches, packing, autocast and
whatever per-token masks it applies; under prompt.history each reply against its own window, as
the learner trains it), on the weights the sampler served, and every action token's
|sampler log p - learner log p| is measured. With exact tokens the two are one number up to float
round-off; a larger gap is a fault the learner would otherwise train on silently: a re-tokenised
reply, a stale or mis-loaded adapter, a mask one side applies and the other not, log-probs taken
after temperature or top-p.

The learner loads its own copy of the model after the rollout's sampler is closed (the hf sampler
serves the adapter merged into its weights, which the learner's LoRA would count twice), so the
two never hold memory at once.
"""

from __future__ import annotations

import bisect
import gc
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from agentrl.config import Config
from agentrl.io import atomic_write_json
from agentrl.models import pick_device, pick_dtype
from agentrl.specs import DEFAULT_TOLERANCE, parse_tolerance
from agentrl.train.learner import LocalLearner, build_learner, per_step_items
from agentrl.train.packing import autocast_dtype

__all__ = ["LogprobCheck", "Worst", "check_logprobs", "precision", "verifier", "verify_rollout"]

RESULT_FILE = "verify_logprobs.json"
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Worst:
    """The action token with the largest gap, named as a user finds it in trajectories.jsonl."""

    game_id: str
    trajectory: int  # index within its group (the record's "trajectory")
    step: int  # the reply's env step, 1-based
    token: int  # the token's place in its reply, 0-based
    position: int  # its index in the record's token_ids (and logprobs)
    sampler: float
    learner: float
    where: str = ""  # the arm's directory under the rollout's output (Tier 1: baseline | gated)

    @property
    def gap(self) -> float:
        return abs(self.sampler - self.learner)


@dataclass
class LogprobCheck:
    tokens: int  # action tokens checked
    trajectories: int
    max: float | None  # None: no action token to check
    p99_9: float | None
    mean: float | None
    worst: Worst | None
    precision: str  # fp32 | bf16 | fp16: the lower of the sampler's weights and the learner's forward
    tolerance: dict[str, float]  # statistic -> its bound

    def value(self, name: str) -> float | None:
        return {"max": self.max, "p99.9": self.p99_9, "mean": self.mean}[name]

    @property
    def over(self) -> list[str]:
        """The statistics above their bound."""
        return [n for n, bound in self.tolerance.items() if self.value(n) is not None and self.value(n) > bound]

    @property
    def passed(self) -> bool:
        return not self.over

    def record(self) -> dict:
        return {"passed": self.passed, "precision": self.precision, "tolerance": self.tolerance,
                "tokens": self.tokens, "trajectories": self.trajectories,
                "max": self.max, "p99.9": self.p99_9, "mean": self.mean, "over": self.over,
                "worst": None if self.worst is None else asdict(self.worst) | {"gap": self.worst.gap}}

    def failure(self) -> str:
        """One line: what is over its bound, and the worst token."""
        over = ", ".join(f"{n} gap {self.value(n):.3g} > {self.tolerance[n]:g}" for n in self.over)
        w = self.worst
        where = f"{w.where}/" if w.where else ""
        return (f"log-prob check failed ({self.precision}): {over}; worst: {where}game {w.game_id} trajectory "
                f"{w.trajectory} step {w.step} token {w.token} (token_ids[{w.position}]): sampler {w.sampler:.6f}, "
                f"learner {w.learner:.6f}")


def verifier(cfg: Config) -> LocalLearner:
    """The learner on the weights the rollout's sampler served: model.adapter as its starting LoRA
    (loaded as `train.init_adapter` is), or without one a fresh LoRA, whose B = 0 leaves the base."""
    adapter = cfg.model.adapter
    return build_learner(replace(cfg, train=replace(cfg.train, init_adapter=adapter)), warm_start=bool(adapter))


def precision(cfg: Config, learner: LocalLearner) -> str:
    """fp32 when the sampler's weights and the learner's forward both are; else the lower one."""
    device = pick_device(cfg.model.device)
    if cfg.sampling.backend == "vllm":  # the dtype the engine is given (its auto is bf16, also on fp32 weights)
        from agentrl.sampling.vllm import vllm_dtype

        sampler = getattr(torch, vllm_dtype(cfg.model.dtype, "cuda" if device.startswith("cuda") else "cpu"))
    else:
        sampler = pick_dtype(cfg.model.dtype, device)
    forward = autocast_dtype(learner.cfg.autocast, learner.device) or learner.model.dtype
    low = [_NAMES.get(d, str(d)) for d in (sampler, forward) if d != torch.float32]
    return low[0] if low else "fp32"


def forwarded(trajectories: list, history: int) -> tuple[list, list[tuple[int, int | None]]]:
    """The items the learner forwards for `trajectories`, and where each came from (trajectory,
    reply; reply None: the whole trajectory). Under prompt.history, `per_step_items` itself cuts
    them; it hands each item its reply's own advantage, so the (trajectory, reply) key passed as
    that advantage comes back with it."""
    if not history:
        keep = [k for k, t in enumerate(trajectories) if any(t.action_mask)]
        return [trajectories[k] for k in keep], [(k, None) for k in keep]
    keyed = [(t, [(k, i) for i in range(len(t.step_tokens))]) for k, t in enumerate(trajectories)]
    pairs = per_step_items(keyed, history)
    return [item for item, _ in pairs], [key[0] for _, key in pairs]


def _token_gaps(learner: LocalLearner, trajectories: list) -> tuple[list[np.ndarray], list]:
    """Per forwarded item, |sampler - learner| over its action tokens, and (item, origin, positions, learner log-probs)."""
    items, origins = forwarded(trajectories, learner.history)
    gaps, meta = [], []
    for item, origin, lp in zip(items, origins, learner.logprobs(items)):
        positions = np.flatnonzero(np.asarray(item.action_mask))
        learned = lp.detach().float().cpu().numpy().astype(np.float64)[positions]
        sampled = np.asarray(item.logprobs, dtype=np.float64)[positions]
        gaps.append(np.nan_to_num(np.abs(sampled - learned), nan=np.inf))  # a NaN on either side is a fault, never a pass
        meta.append((item, origin, positions, learned))
    return gaps, meta


def _worst(trajectories: list, meta: tuple, j: int, where: str) -> Worst:
    """The j-th action token of a forwarded item, located in its trajectory's record."""
    item, (k, reply), positions, learned = meta
    t = trajectories[k]
    p = int(positions[j])
    position = p if reply is None else t.reply_starts[reply] + (p - int(positions[0]))  # a window's reply ends it
    step = bisect.bisect_right(t.reply_starts, position) - 1
    return Worst(t.game.game_id, t.index, step + 1, position - t.reply_starts[step], position,
                 float(item.logprobs[p]), float(learned[j]), where)


def check_logprobs(learner: LocalLearner, arms: list[tuple[str, list]], tolerance: dict[str, float],
                   precision_name: str) -> LogprobCheck:
    """The gap statistics over every action token of `arms` ([(where, trajectories)]: one rollout,
    or Tier 1's two arms) under `learner`, judged against `tolerance`."""
    gaps, worst, best = [], None, -1.0
    for where, trajectories in arms:
        per_item, meta = _token_gaps(learner, trajectories)
        for g, m in zip(per_item, meta):
            if g.size and g.max() > best:
                j = int(g.argmax())
                best, worst = float(g[j]), _worst(trajectories, m, j, where)
        gaps += per_item
    flat = np.concatenate(gaps) if gaps else np.zeros(0)
    stats = (float(flat.max()), float(np.percentile(flat, 99.9)), float(flat.mean())) if flat.size else (None, None, None)
    return LogprobCheck(int(flat.size), sum(len(t) for _, t in arms), *stats, worst, precision_name, dict(tolerance))


def verify_rollout(cfg: Config, arms: list[tuple[str, list]], out: Path) -> LogprobCheck:
    """`agentrl rollout --verify-logprobs`: the check on the rollout's trajectories (its sampler
    already closed), written to `out/verify_logprobs.json`."""
    gc.collect()  # the sampler's weights and KV store, if nothing holds them any more
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    learner = verifier(cfg)
    try:
        name = precision(cfg, learner)
        tolerance = parse_tolerance(cfg.rollout.verify_tolerance) or DEFAULT_TOLERANCE["fp32" if name == "fp32" else "low"]
        check = check_logprobs(learner, arms, tolerance, name)
    finally:
        learner.close()
    atomic_write_json(Path(out) / RESULT_FILE, check.record())
    return check
