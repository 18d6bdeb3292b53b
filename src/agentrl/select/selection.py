"""The stages a run selects (`--select`), applied at their points of each iteration, and the
accounting that puts them side by side in metrics.jsonl."""

from __future__ import annotations

import dataclasses

from agentrl.rollout.lockstep import Rollout, RolloutStats
from agentrl.rollout.trajectory import zero_advantage_tokens

from agentrl.errors import UserError
from agentrl.select import pilot_count, stage_names
from agentrl.select.arrol_stage import ArrolStage
from agentrl.select.cut import CutStage
from agentrl.select.dapo import DapoFilter
from agentrl.select.greso import Greso
from agentrl.select.pilot_commit import PilotCommit


def build_stage(name: str, cfg, sampler=None):
    s = cfg.select
    if name == "cut":
        return CutStage.from_spec(cfg.rollout.parsed_gate(), s.gate_audit, cfg.seed, cfg.gate)
    if name == "dapo":
        return DapoFilter(s.dapo_refill)
    if name == "greso":
        g = s.greso
        return Greso(seed=cfg.seed, p_start=g.p_init, target_easy=g.target / 3, target_hard=g.target * 2 / 3,
                     step=g.step, p_min=g.p_min, p_max=g.p_max, count_pilots=g.count_pilots)
    if name == "pilot-commit":
        p = s.pilot_commit
        return PilotCommit(n_p=pilot_count(cfg), pilot_factor=p.pilot_factor, low=p.low, high=p.high,
                           group_size=cfg.rollout.group_size, evict_at=p.evict_at, max_rounds=p.max_rounds,
                           max_age=p.max_age, sampling=p.sampling, seed=cfg.seed)
    if name == "arrol":
        if sampler is None or sampler.model is None:
            raise UserError("--select arrol reads the policy's hidden states: it needs the hf sampler (--sampler hf)")
        a = s.arrol
        return ArrolStage(sampler, K=a.K, kappa=a.kappa, cold_start=a.cold_start, seed=cfg.seed,
                          max_steps=cfg.t_max("rollout"), rule=a.rule, balance=a.balance,
                          s_min=a.s_min, s_max=a.s_max)
    raise UserError(f"unknown selection stage {name!r}")


class Selection:
    def __init__(self, cfg, sampler=None, warn=None):
        self.stages = [build_stage(name, cfg, sampler) for name in stage_names(cfg)]
        self.by_name = {s.name: s for s in self.stages}
        self.warn = warn or (lambda message: None)

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

        GRESO scans a random stream of the pool and skips tasks. Pilot-Commit runs rounds: commit
        the buffered tasks that passed a pilot (their other G - n_p trajectories, with the step
        stages), pilot n_p trajectories on pilot_factor x B fresh tasks (no step stages: the
        pilot needs final outcomes), until B tasks are committed or max_rounds."""
        greso, pc = self.by_name.get("greso"), self.by_name.get("pilot-commit")
        if greso:
            greso.pool_size = len(tasks.pool)  # an epoch is a pass over the pool
        if pc is None:
            games = greso.choose(tasks.stream(), B) if greso else tasks.select(B)
            return roll(games, G, 0, self.step_stages)
        candidates = iter(greso.passing(tasks.stream()) if greso else tasks.stream())
        groups, stats, committed, rounds = [], [], 0, 0
        pilot_at: dict[str, int] = {}  # game_id -> index in groups of this iteration's pilot group
        for rounds in range(1, pc.max_rounds + 1):
            entries = pc.take(B - committed)
            if entries:  # commit: the other G - n_p trajectories of tasks that passed a pilot
                commit = roll([e.game for e in entries], G - pc.n_p, pc.n_p, self.step_stages)
                stats.append(commit.stats)
                for e, c in zip(entries, commit.groups):
                    here = pilot_at.pop(e.game.game_id, None)
                    if here is not None:
                        groups[here] = None  # piloted this iteration: the merged group replaces it
                    groups.append(merge_group(e.pilot, c, carried=0 if here is not None else e.pilot.step_tokens))
                committed += len(entries)
            fresh = pc.pilot_tasks(candidates, B)  # pilot: fresh tasks, in the same round (T 529)
            if fresh:
                pilot = roll(fresh, pc.n_p, 0, [])
                stats.append(pilot.stats)
                pc.decide(pilot.groups)
                for g in pilot.groups:
                    g.excluded_by = "pilot-commit"  # out of this iteration's loss (a passed one may be committed later)
                    pilot_at[g.game.game_id] = len(groups)
                    groups.append(g)
            if committed >= B or (not fresh and not pc.buffer):
                break
        groups = [g for g in groups if g is not None]
        out_of_loss = sum(g.step_tokens for g in groups if g.excluded_by == "pilot-commit")
        n_pilot_traj = sum(len(g.trajectories) for g in groups if g.excluded_by == "pilot-commit")
        pc.account(committed, out_of_loss, rounds, out_of_loss / n_pilot_traj if n_pilot_traj else 0.0)
        pc.flush()
        if (why := pc.nothing_committed()) is not None:
            self.warn(why)
        return Rollout(groups, RolloutStats(*(sum(getattr(s, f) for s in stats) for f in
                                              ("env_steps", "step_tokens", "generate_s", "env_s", "wall_s"))))

    def refill_tasks(self, tasks, n: int) -> list:
        """n more tasks for a DAPO refill round, through the before-rollout filter (GRESO) as the
        authors' refill rounds are (RT 988-1016)."""
        greso = self.by_name.get("greso")
        return greso.choose(tasks.stream(), n, refill=True) if greso else tasks.select(n)

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
            # refill rounds and pruned included; not the pilot tokens a commit carried from an earlier iteration
            "step_tokens_generated": sum(g.step_tokens - g.carried_step_tokens for g in groups),
            "step_tokens_carried": sum(g.carried_step_tokens for g in groups),
            "step_tokens_excluded_by_stages": sum(st.step_tokens_excluded for st in stages.values()),
            # in the batch with A = 0 (a zero-variance group no stage removed; GiGPO: steps with A = 0): generated, not trained
            "step_tokens_zero_advantage": sum(zero_advantage_tokens(t, a) for t, a in batch),
            "step_tokens_avoided_est": sum(st.step_tokens_avoided for st in stages.values()),
        }

    def state_dict(self) -> dict:
        return {s.name: s.state_dict() for s in self.stages}

    def load_state_dict(self, state: dict) -> None:
        for name, st in (state or {}).items():
            if name in self.by_name:
                self.by_name[name].load_state_dict(st)


def merge_group(pilot, commit, carried: int = 0):
    """One group: a committed task's pilot + commit trajectories (the gate's verdict on the
    commit part applies to the group). `carried`: the pilot's step tokens if it was generated
    in an earlier iteration."""
    return dataclasses.replace(commit, trajectories=pilot.trajectories + commit.trajectories,
                               pruned=pilot.pruned + commit.pruned, generate_s=pilot.generate_s + commit.generate_s,
                               env_s=pilot.env_s + commit.env_s, wall_s=pilot.wall_s + commit.wall_s,
                               carried_step_tokens=carried)
