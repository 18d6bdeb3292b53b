"""CUT_{K,d_L}, the Selective Rollout gate, as a stage (point: step K), with an online audit.

After env step K the stage asks its rule (`agentrl.select.gate_rule.GateRule`; today d_K < d_L,
fixed or fitted online) whether a group has converged; if so the group is stopped and kept out
of the loss, and after the iteration the rule learns from the groups that ran to the end. The
audit (`--gate-audit a`, nobody else has it) lets a share a of the groups the gate would cut run
to the end anyway, still kept out of the loss: their final
rewards are the ground truth for the gate's live precision (share of would-cut groups that
end zero-variance) and, with the groups it let run, an estimate of its recall (share of the
zero-variance groups it catches) — numbers the paper could only get from a matched baseline.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.config import GateConfig
from agentrl.rollout.lockstep import row_seed
from agentrl.select.auto_gate import FittedThreshold, read_warmup, read_warmup_rows
from agentrl.select.classifier_gate import ClassifierGate, Example, row_ended
from agentrl.select.base import StageStats
from agentrl.select.gate_rule import GateLabel, GateRule, NoWin, Threshold
from agentrl.specs import GateSpec


def gate_rule(spec: GateSpec, auto: GateConfig | None = None) -> GateRule:
    """The rule a parsed `--gate` spec names: a fixed threshold, or for `K,auto` the threshold
    fitted online with the config's `gate` section (precision, min_labels, window, warmup); for
    `K,nowin` the rule that cuts groups with no row ended by K."""
    if spec.nowin:
        return NoWin(spec.K)
    if not spec.auto:
        return Threshold(spec.K, spec.d_L, spec.tau_H, spec.signal)
    a = auto or GateConfig()
    if spec.signals:  # K,auto:S1+S2+...: a classifier on several signals
        wanted = tuple(dict.fromkeys((*spec.signals, "termination_fraction")))  # the guard reads who had ended
        rows = read_warmup_rows(Path(a.warmup), spec.K, wanted) if a.warmup else []
        warm = [Example(0, tuple(row[s] for s in spec.signals), zero, 1.0, row_ended(row))
                for row, zero in rows]
        return ClassifierGate(spec.K, spec.signals, spec.tau_H, a.precision, a.min_labels, a.window, warm)
    warmup = read_warmup(Path(a.warmup), spec.K, spec.signal) if a.warmup else None
    return FittedThreshold(spec.K, spec.signal, spec.tau_H, a.precision, a.min_labels, a.window, warmup)


class CutStage:
    name = "cut"
    point = "step"

    def __init__(self, rule: GateRule, audit: float = 0.0, seed: int = 0):
        self.rule, self.K, self.audit, self.seed = rule, rule.K, audit, seed
        self.iteration, self._seen, self._looked = 0, [], []

    @classmethod
    def from_spec(cls, spec: GateSpec, audit: float = 0.0, seed: int = 0, auto: GateConfig | None = None) -> "CutStage":
        """The stage of a parsed `--gate` spec (`auto`: the config's `gate` section, for `K,auto`)."""
        return cls(gate_rule(spec, auto), audit, seed)

    def begin(self, iteration: int) -> None:
        self.iteration, self._seen, self._looked = iteration, [], []

    def at_step(self, step: int, group) -> None:
        """Called right after env step K for a group with its signals at K."""
        still_running = [t for t in group.trajectories if not t.done]
        # a group that already finished has nothing left to save: the gate leaves it alone
        if step != self.K or not still_running:
            return
        fires = self.rule.fires(group.signals[step])
        # the draw is fixed by (seed, task, iteration), whatever order the groups come in
        audited = fires and self.audit > 0 and row_seed(self.seed, group.game.game_id, -1, self.iteration) / 2**63 < self.audit
        self._looked.append((group, "audited" if audited else "cut" if fires else "ran"))
        if not fires:
            return
        group.live_at_cut = len(still_running)
        if audited:
            group.excluded_by = "cut"  # audited: runs to the end, kept out of the loss
            return
        group.cut, group.cut_step = True, step
        for t in still_running:
            t.stop_reason = "gate_cut"

    def observe(self, groups: list) -> None:
        self._seen = list(groups)
        # the rule learns from the groups it looked at that ran to the end (a cut one has no label)
        labels = [GateLabel(group.signals[self.K], group.zero_variance, how == "audited", self.audit)
                  for group, how in self._looked if how != "cut"]
        self.rule.learn(self.iteration, labels)

    def stats(self) -> StageStats:
        groups = self._seen  # the iteration's final groups (a Pilot-Commit group includes its pilot)
        cut, audited = [g for g in groups if g.cut], [g for g in groups if g.audited]
        tokens = sum(g.kept_step_tokens for g in cut + audited)  # ARRoL accounts for what it pruned
        after_k = _tokens_after_k_per_live_trajectory(groups, self.K)
        avoided = round(after_k * sum(g.live_at_cut for g in cut)) if after_k is not None else 0
        out = StageStats({"groups_cut": len(cut), "groups_audited": len(audited)},
                         step_tokens_generated=tokens, step_tokens_excluded=tokens, step_tokens_avoided=avoided)
        if audited:  # ground truth: how the groups it would have cut really ended
            zero = sum(g.zero_variance for g in audited)
            out.precision = zero / len(audited)
            # zero-variance groups it would cut (estimated from the audited share) vs those it let run
            would_cut_zero = out.precision * (len(cut) + len(audited))
            missed = sum(g.zero_variance for g in groups if not g.cut and not g.audited and not g.excluded_by)
            out.extra = {"recall_est": would_cut_zero / (would_cut_zero + missed) if would_cut_zero + missed else None,
                         "audited_zero_variance": zero}
        report = self.rule.report()  # a rule that learns: e.g. the d_L the next iteration uses
        if report is not None:
            out.extra["auto"] = report
        return out

    def state_dict(self) -> dict:
        # the audit draw is keyed by (seed, iteration, task); a rule that learns keeps its state
        # (under "auto", the key checkpoints of `K,auto` runs have)
        rule = self.rule.state_dict()
        return {"auto": rule} if rule else {}

    def load_state_dict(self, state: dict) -> None:
        if "auto" in state:
            self.rule.load_state_dict(state["auto"])


def _tokens_after_k_per_live_trajectory(groups: list, K: int) -> float | None:
    """Mean step-tokens a trajectory still running at K generated after K, over the groups that
    ran to the end (audited ones included): the cost a cut saves per trajectory it stops."""
    spent = [sum(t.step_tokens[K:]) for g in groups if not g.cut for t in g.trajectories if len(t.step_tokens) > K]
    return sum(spent) / len(spent) if spent else None
