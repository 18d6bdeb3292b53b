"""Advantages: what each trained token is weighted by.

GRPO family, per trajectory (Eq. 1 of the paper): A_i = (r_i - mean) / (std + eps), population
std (`dr_grpo`: no std; `rloo`: leave-one-out baseline). A zero-variance group gets A = 0 for
every trajectory: it teaches nothing, which is why the gate may stop it early.

RAFT (`--advantage raft`; Dong et al. 2023, "RAFT: Reward rAnked FineTuning"; with the clipped
ratio of later minibatches, Xiong et al. 2025's RAFT++): A_i = 1 if R_i > 0 (a win) else 0, no
baseline. The policy-gradient step on it is behaviour cloning on the iteration's wins, so
`agentrl sft --from` (rejection-sampling fine-tuning) runs online, inside the loop. Here an
all-fail group teaches nothing and an all-success group teaches fully: a cut of all-success
groups drops signal (`advantage_mass` measures it); `--gate K,nowin` cuts only groups with no win.

GiGPO, per step (`--advantage gigpo`; Feng et al. 2025, "Group-in-Group Policy Optimization"),
written after the authors' code, langfengQ/verl-agent gigpo/core_gigpo.py at 29e3e8b (Lang
Feng, 2025-09-03; read in its fork johnhaofu/verl-agent, which carries that commit unchanged):
A(i, t) = A_E(i, t) + omega * A_S(i, t), every token of step t's reply carries A(i, t). Under
GiGPO an all-success group of unequal lengths still has signal (a shorter path earns a larger
discounted return), so a cut can drop signal: `advantage_mass` measures how much.

Cut groups and groups a selection stage excluded never enter the batch, unless
`advantage.cut_groups: zero` puts the gate's cut (and audited) groups in at A = 0: no forward
pass, but they count in the loss's N (seq-sum) or token total (token-mean, their tokens up to the
cut), as an ungated run's all-fail group would. The default, `drop`, is the paper's: a cut group
leaves the batch and its N, so the kept trajectories' gradient grows by sampled / kept (its
section 4.4, "dilution"); under `raft` with most groups cut that multiplies a few wins' step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from agentrl.config import ADVANTAGES as ESTIMATORS
from agentrl.config import AdvantageConfig, RewardConfig, TrainConfig


def group_advantages(rewards, estimator: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if estimator == "grpo":
        return (r - r.mean()) / (r.std() + eps)
    if estimator == "dr_grpo":  # no std division
        return r - r.mean()
    if estimator == "rloo":  # leave-one-out baseline
        n = len(r)
        return r - (r.sum() - r) / (n - 1) if n > 1 else np.zeros_like(r)
    if estimator == "raft":  # no baseline: a win is cloned, anything else teaches nothing
        return (r > 0).astype(np.float64)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


# ---------------------------------------------------------------- GiGPO
def _normalise(scores: list[float], std_norm: bool, eps: float, single_mean: bool) -> list[float]:
    """core_gigpo.py's mean/std normalisation of one group's scores: torch.std's default (Bessel,
    n - 1), eps added to the std; a group of one keeps std 1 and has mean 0 at the episode level
    (L225-227, `single_mean=False`) but its own score at the step level (L367-369: A_S = 0)."""
    x = np.asarray(scores, dtype=np.float64)
    if len(x) == 1:
        mean, std = (float(x[0]) if single_mean else 0.0), 1.0
    else:
        mean, std = float(x.mean()), float(x.std(ddof=1))
    return ((x - mean) / (std + eps) if std_norm else x - mean).tolist()


def gigpo_parts(rewards, states, gamma: float, std_norm: bool = True, step_rewards=None, penalties=None,
                eps: float = 1e-6) -> tuple[list[list[float]], list[list[float]], list[int]]:
    """(A_E, A_S, step-group sizes) of one group; see `gigpo_step_advantages`."""
    n = len(rewards)
    if len(states) != n:
        raise ValueError(f"{n} rewards but {len(states)} state lists")
    lengths = [len(s) for s in states]
    if step_rewards is None:  # the outcome arrives with the last step (ALFWorld: the winning one)
        step_rewards = [[0.0] * (L - 1) + [float(r)] if L else [] for r, L in zip(rewards, lengths)]
    if penalties is None:
        penalties = [[0.0] * L for L in lengths]
    for name, per_step in (("step_rewards", step_rewards), ("penalties", penalties)):
        if [len(p) for p in per_step] != lengths:
            raise ValueError(f"{name} must have one entry per step of each trajectory")

    # Episode level (episode_norm_reward, L174-241). Every step row of trajectory i scores the
    # episode's reward (agent_system/reward_manager/episode.py L72-79 writes it on every step),
    # less that step's penalty (ray_trainer.py apply_invalid_action_penalty L200-221). The mean and
    # std are pooled over all step rows of the group (compute_mean_std_cross_steps=True, its
    # default, L180/L221), so longer trajectories weigh more. The paper's Eq. 3 normalises over
    # the G episodes instead; we follow the code.
    rows = [float(r) - p for r, pen in zip(rewards, penalties) for p in pen]
    flat = iter(_normalise(rows, std_norm, eps, single_mean=False) if rows else [])
    a_e = [[next(flat) for _ in range(L)] for L in lengths]

    # Step level. Returns R_t = r_t + gamma * R_{t+1}, a step's own reward included
    # (compute_step_discounted_returns, L87-135); the penalty is subtracted from R_t after the
    # discounting, so it never reaches earlier steps (ray_trainer.py L1111-1116, then L1203-1206).
    returns = []
    for rs, pen in zip(step_rewards, penalties):
        out, running = [0.0] * len(rs), 0.0
        for t in reversed(range(len(rs))):
            running = float(rs[t]) + gamma * running
            out[t] = running - pen[t]
        returns.append(out)
    # Step groups: identical anchor states within the group (build_step_group, L243-331, exact
    # match: enable_similarity=False, its default); each normalised alone (step_norm_reward, L334-383).
    members: dict = defaultdict(list)
    for i, s in enumerate(states):
        for t, key in enumerate(s):
            members[key].append((i, t))
    a_s = [[0.0] * L for L in lengths]
    for cells in members.values():
        for (i, t), v in zip(cells, _normalise([returns[i][t] for i, t in cells], std_norm, eps, single_mean=True)):
            a_s[i][t] = v
    return a_e, a_s, [len(c) for c in members.values()]


def gigpo_step_advantages(rewards, states, gamma: float, omega: float, std_norm: bool = True, step_rewards=None,
                          penalties=None, eps: float = 1e-6) -> list[list[float]]:
    """GiGPO's A(i, t) = A_E(i, t) + omega * A_S(i, t) for the trajectories of one group.

    `rewards[i]`: trajectory i's final reward; `states[i][t]`: the anchor state before its step t
    (any hashable; identical keys form a step group); `step_rewards[i][t]`: None = 0 except the
    last step, which gets rewards[i]; `penalties[i][t]` (>= 0, verl-agent's invalid-action
    penalty): taken off step t's episode-level score and its return, undiscounted.
    `std_norm`: verl-agent's mode mean_std_norm (True) or mean_norm (False)."""
    a_e, a_s, _ = gigpo_parts(rewards, states, gamma, std_norm, step_rewards, penalties, eps)
    return [[e + omega * s for e, s in zip(es, ss)] for es, ss in zip(a_e, a_s)]


def anchor_states(traj) -> list[str]:
    """The observation the agent saw before each of its replies (verl-agent's `anchor_obs`: the
    env's text without history or prompt): step 0's is the game's initial observation."""
    seen = [traj.initial_observation] + [s.observation for s in traj.steps]
    return seen[: len(traj.step_tokens)]  # a reply whose env step failed (env_error) still has its anchor


# ---------------------------------------------------------------- the batch
@dataclass
class Advantage:
    """The run's advantage function (`train.advantage` with `advantage.*` and `reward.*`)."""

    # the defaults are the config's (declared once, there: `train.advantage`, `advantage.*`, `reward.*`)
    estimator: str = TrainConfig.advantage
    gamma: float = AdvantageConfig.gamma
    omega: float = AdvantageConfig.omega
    std_norm: bool = AdvantageConfig.std_norm
    invalid_action: float = RewardConfig.invalid_action  # reward of a step whose reply maps to no admissible command (<= 0)
    invalid_action_in: str = RewardConfig.invalid_action_in  # into the return (before normalising) or the advantage (after)
    mask_cut_replies: bool = AdvantageConfig.mask_cut_replies  # a reply cut at max_new_tokens gets A = 0
    cut_groups: str = AdvantageConfig.cut_groups  # the gate's cut groups: drop (out of N) | zero (in N at A = 0)

    @classmethod
    def of(cls, cfg) -> "Advantage":
        a = cfg.advantage
        return cls(cfg.train.advantage, a.gamma, a.omega, a.std_norm, cfg.reward.invalid_action,
                   cfg.reward.invalid_action_in, a.mask_cut_replies, a.cut_groups)

    @property
    def per_step(self) -> bool:
        return self.estimator == "gigpo"

    def of_group(self, group) -> list:
        """One advantage per trajectory of the group: a number, or (GiGPO) a list with one per reply."""
        trajs = group.trajectories
        if self.per_step:
            adv = gigpo_step_advantages([t.reward for t in trajs], [anchor_states(t) for t in trajs], self.gamma,
                                        self.omega, self.std_norm, penalties=[self.penalties(t) for t in trajs])
        elif self.invalid_action_in == "return":
            # an invalid-action penalty makes the trajectory's return R + penalty x invalid steps
            adv = group_advantages([t.reward + self.invalid_action * t.invalid_actions for t in trajs],
                                   self.estimator).tolist()
        else:
            adv = group_advantages([t.reward for t in trajs], self.estimator).tolist()
            if self.invalid_action and len({t.reward for t in trajs}) > 1:
                # after the normalisation: the penalty keeps its own scale and a zero-variance group stays out
                adv = [self._per_reply(t, a, [-p for p in self.penalties(t)]) for t, a in zip(trajs, adv)]
        if self.mask_cut_replies:
            adv = [self._per_reply(t, a, [0.0] * len(t.step_tokens), zero=t.cut_steps) for t, a in zip(trajs, adv)]
        return adv

    @staticmethod
    def _per_reply(traj, a, added: list[float], zero=()) -> "float | list[float]":
        """`a` (a number or one per reply) plus `added` per reply, 0 on the replies in `zero`; a
        number stays a number where nothing changes, so the learner's A = 0 skip still applies."""
        per_reply = list(a) if isinstance(a, (list, tuple)) else [a] * len(traj.step_tokens)
        out = [0.0 if i in zero else x + d for i, (x, d) in enumerate(zip(per_reply, added))]
        return out if out != per_reply or isinstance(a, (list, tuple)) else a

    def penalties(self, traj) -> list[float]:
        steps = traj.steps
        return [-self.invalid_action if t < len(steps) and not steps[t].valid else 0.0 for t in range(len(traj.step_tokens))]

    def step_group_sizes(self, group) -> list[int]:
        trajs = group.trajectories
        return gigpo_parts([t.reward for t in trajs], [anchor_states(t) for t in trajs], self.gamma, self.std_norm)[2]


def batch_advantages(groups, advantage: "str | Advantage" = "grpo") -> list[tuple[object, object]]:
    """(trajectory, advantage) for every trajectory that reaches the loss: cut groups, groups a
    selection stage excluded (`excluded_by`: the DAPO filter, select/dapo.py, among them) and
    groups an env failure touched (`env_failed`) never enter; with `cut_groups: zero` the gate's
    cut and audited groups enter at A = 0 (counted in N, never forwarded)."""
    fn = advantage if isinstance(advantage, Advantage) else Advantage(advantage)
    out = []
    for g in groups:
        by = getattr(g, "excluded_by", None)
        if getattr(g, "env_failed", False) or by not in (None, "cut"):
            continue
        if g.cut or by == "cut":
            if fn.cut_groups == "zero":
                out.extend((t, 0.0) for t in g.trajectories)
            continue
        out.extend(zip(g.trajectories, fn.of_group(g)))
    return out


def _squared(traj, a) -> float:
    """Sum over a trajectory's steps of A(i, t)^2 (a trajectory-level advantage counts once per step)."""
    return sum(x * x for x in a) if isinstance(a, list) else a * a * len(traj.step_tokens)


def advantage_mass(groups, batch, fn: Advantage) -> dict:
    """What the gate's cuts dropped, in advantage: the squared L2 norm of the per-step advantages
    in the loss (`batch`) vs in the groups the audit let run (`--gate-audit`: the gate would have
    cut them; they ran to the end, so their advantages are known), and an estimate of the share
    of the iteration's advantage mass the gate dropped (the audited groups' mean mass per group
    stands in for every group the gate cut or would have cut)."""
    kept = [g for g in groups if not g.cut and not g.excluded_by and not g.env_failed]
    audited = [g for g in groups if g.excluded_by == "cut" and not g.cut]
    n_cut = sum(g.cut for g in groups)
    kept_sq = sum(_squared(t, a) for t, a in batch)
    audited_sq = sum(_squared(t, a) for g in audited for t, a in zip(g.trajectories, fn.of_group(g)))
    out = {"kept_groups": len(kept), "kept_l2": round(kept_sq ** 0.5, 6), "audited_groups": len(audited),
           "audited_l2": round(audited_sq ** 0.5, 6), "cut_groups": n_cut}
    if audited:
        dropped = audited_sq / len(audited) * (n_cut + len(audited))
        out["dropped_share_est"] = round(dropped / (dropped + kept_sq), 6) if dropped + kept_sq > 0 else 0.0
    if fn.per_step:
        sizes = [s for g in kept for s in fn.step_group_sizes(g)]
        out["step_group_size_mean"] = round(float(np.mean(sizes)), 4) if sizes else None
    return out
