"""The stages a run selects (`--select`), applied at their points of each iteration, and the
accounting that puts them side by side in metrics.jsonl."""

from __future__ import annotations

import dataclasses
import math

from agentrl.errors import UserError
from agentrl.select import stage_names


def build_stage(name: str, cfg, sampler=None):
    s = cfg.select
    if name == "cut":
        from agentrl.select.cut import CutStage

        return CutStage(cfg.rollout.parsed_gate(), s.gate_audit, cfg.seed)
    if name == "dapo":
        from agentrl.select.dapo import DapoFilter

        return DapoFilter(s.dapo_refill)
    if name == "greso":
        from agentrl.select.greso import Greso

        g = s.greso
        return Greso(seed=cfg.seed, p_start=g.p_init, target_easy=g.target / 3, target_hard=g.target * 2 / 3,
                     step=g.step, p_min=g.p_min)
    if name == "pilot-commit":
        from agentrl.select.pilot_commit import PilotCommit

        p = s.pilot_commit
        return PilotCommit(n_p=p.n_pilot, pilot_factor=p.pilot_factor, low=p.low, high=p.high,
                           group_size=cfg.rollout.group_size)
    if name == "arrol":
        from agentrl.select.arrol_stage import ArrolStage

        if not hasattr(sampler, "model"):
            raise UserError("--select arrol reads the policy's hidden states: it needs the hf sampler (--sampler hf)")
        a = s.arrol
        return ArrolStage(sampler, K=a.K, kappa=a.kappa, cold_start=a.cold_start, seed=cfg.seed,
                          max_steps=cfg.rollout.max_steps or cfg.env.max_steps)
    raise UserError(f"unknown selection stage {name!r}")


class Selection:
    def __init__(self, cfg, sampler=None):
        self.stages = [build_stage(name, cfg, sampler) for name in stage_names(cfg)]
        self.by_name = {s.name: s for s in self.stages}

    @property
    def step_stages(self) -> list:
        return [s for s in self.stages if s.point == "step"]

    def begin(self, iteration: int) -> None:
        for s in self.stages:
            if hasattr(s, "begin"):
                s.begin(iteration)

    def rollout(self, tasks, B: int, G: int, roll):
        """Before-rollout stages, then the rollout with the step stages (CUT, ARRoL) in it.
        `roll(games, group_size, first_index, stages) -> Rollout`.

        GRESO scans a random stream of the pool and skips tasks; Pilot-Commit rolls out n_p
        trajectories on pilot_factor x B of them (no step stages: the pilot needs final
        outcomes), then the other G - n_p on the committed tasks (with the step stages)."""
        greso, pc = self.by_name.get("greso"), self.by_name.get("pilot-commit")
        if pc is None:
            games = greso.choose(tasks.stream(), B) if greso else tasks.select(B)
            return roll(games, G, 0, self.step_stages)
        candidates = tasks.stream()
        if greso:
            candidates = greso.choose(candidates, math.ceil(pc.pilot_factor * B))
        pilot = roll(pc.pilot_tasks(candidates, B), pc.n_p, 0, [])
        decision = pc.decide(pilot.groups)
        commit = roll(decision.commit, G - pc.n_p, pc.n_p, self.step_stages)
        return merge_pilot_commit(pilot, commit)

    def keep(self, rollout, refill, B: int) -> list:
        """After rollout: the groups that enter the loss. `refill(n)` rolls out n more tasks; their
        groups join the rollout (their cost is counted)."""
        def more(n: int) -> list:
            extra = refill(n).groups
            rollout.groups.extend(extra)
            return extra

        groups = rollout.groups
        for s in self.stages:
            if s.point == "after":
                groups = s.keep(groups, refill=more, want=B)
        return groups

    def observe(self, groups: list) -> None:
        for s in self.stages:
            s.observe(groups)

    def metrics(self, groups: list, batch: list) -> dict:
        """Per stage: decisions, step-tokens generated / kept out of the loss / avoided, precision.
        Totals: generated = trained + kept out by stages + the zero-advantage rest."""
        stages = {s.name: s.stats() for s in self.stages}
        return {
            "stages": {name: st.row() for name, st in stages.items()},
            "trajectories_generated": sum(len(g.trajectories) for g in groups),
            "step_tokens_generated": sum(g.step_tokens for g in groups),  # refill rounds and pruned included
            "step_tokens_excluded_by_stages": sum(st.step_tokens_excluded for st in stages.values()),
            # in the batch with A = 0 (a zero-variance group no stage removed): generated, not trained
            "step_tokens_zero_advantage": sum(sum(t.step_tokens) for t, a in batch if a == 0.0),
            "step_tokens_avoided_est": sum(st.step_tokens_avoided for st in stages.values()),
        }

    def state_dict(self) -> dict:
        return {s.name: s.state_dict() for s in self.stages}

    def load_state_dict(self, state: dict) -> None:
        for name, st in (state or {}).items():
            if name in self.by_name:
                self.by_name[name].load_state_dict(st)


def merge_pilot_commit(pilot, commit):
    """One rollout: a committed task's group = its pilot + commit trajectories (the gate's verdict
    on the commit part applies to the group); the other pilot groups stay, out of the loss."""
    from agentrl.rollout.lockstep import Rollout, RolloutStats

    committed = {g.game.game_id: g for g in commit.groups}
    groups = []
    for g in pilot.groups:
        c = committed.get(g.game.game_id)
        if c is None:
            g.excluded_by = "pilot-commit"
            groups.append(g)
        else:
            groups.append(dataclasses.replace(c, trajectories=g.trajectories + c.trajectories, pruned=g.pruned + c.pruned,
                                              generate_s=g.generate_s + c.generate_s, env_s=g.env_s + c.env_s,
                                              wall_s=pilot.stats.wall_s + c.wall_s))
    a, b = pilot.stats, commit.stats
    stats = RolloutStats(a.env_steps + b.env_steps, a.step_tokens + b.step_tokens, a.generate_s + b.generate_s,
                         a.env_s + b.env_s, a.wall_s + b.wall_s)
    return Rollout(groups, stats)
