"""The signals of a group at step K: the seed paper's seven divergences (App. B; DESIGN.md) and
two of issue 49, the share of invalid actions and the replies' mean negative log-prob.

Each is computed over the G partial trajectories of one task. A trajectory that finished
before K keeps its actual (shorter) prefix; its last action and observation stand for
a_{i,K} and o_{i,K}. All values lie in [0, 1] except reply_nll_mean (nats per token, >= 0).

One definition for every tier: `signals_at(traces, K)` reads a `Trace` per trajectory, built
from a live trajectory during the rollout (Tiers 1 and 3, `Trace.of`) or from its
trajectories.jsonl record (Tier 2's buffer), and applies the one "finished by K" rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from rapidfuzz.distance import Levenshtein

from agentrl.rollout.trajectory import Trajectory
from agentrl.specs import SIGNAL_NAMES

SIGNALS = SIGNAL_NAMES  # named once, at the bottom layer (config parses `K,auto:SIGNAL`)


def prefix_edit_distance(a: list[str], b: list[str]) -> float:
    """Levenshtein over action sequences (each action one symbol) / the longer length; 0 for two empties."""
    longest = max(len(a), len(b))
    return Levenshtein.distance(a, b) / longest if longest else 0.0


def bigram_distance(a: list[str], b: list[str]) -> float:
    """1 - Jaccard of the sets of consecutive action pairs; 0 when both sets are empty."""
    sa, sb = set(zip(a, a[1:])), set(zip(b, b[1:]))
    union = sa | sb
    return 1.0 - len(sa & sb) / len(union) if union else 0.0


def d_K(actions: list[list[str]]) -> float:
    """Mean pairwise normalised edit distance between the G action prefixes (the gate's signal)."""
    pairs = list(combinations(actions, 2))
    return sum(prefix_edit_distance(a, b) for a, b in pairs) / len(pairs) if pairs else 0.0


INVALID = "invalid:"  # how `command_symbol` marks an action that mapped to no admissible command


def compute_signals(actions: list[list[str]], observations: list[str], finished: list[bool],
                    replies: list[list[tuple[float, int]]] | None = None) -> dict[str, float]:
    """The signals of G action prefixes (symbols of `command_symbol`), the observations after
    their last step and which had finished; `replies` holds, per trajectory, (sum of log-probs,
    tokens) of each reply in the prefix (None or empty: no generated tokens, NLL 0)."""
    g = len(actions)
    if g == 0 or len(observations) != g or len(finished) != g or (replies is not None and len(replies) != g):
        raise ValueError("actions, observations, finished (and replies) need one entry per trajectory (G >= 1)")
    pairs = list(combinations(actions, 2))
    last = [a[-1] if a else None for a in actions]
    counts = Counter(last)
    entropy = -sum(c / g * math.log(c / g) for c in counts.values())
    return {
        "prefix_edit_distance_mean": d_K(actions),
        "action_bigram_jaccard_mean": sum(bigram_distance(a, b) for a, b in pairs) / len(pairs) if pairs else 0.0,
        "unique_prefix_ratio": len({tuple(a) for a in actions}) / g,
        "unique_action_ratio": len(counts) / g,
        "action_entropy": max(0.0, entropy / math.log(g)) if g > 1 else 0.0,
        "obs_unique_ratio": len(set(observations)) / g,
        "termination_fraction": sum(bool(f) for f in finished) / g,
        # pooled over the group's steps and tokens, so a long prefix weighs more than a short one
        "invalid_action_fraction": _share(sum(a.startswith(INVALID) for p in actions for a in p),
                                          sum(len(p) for p in actions)),
        "reply_nll_mean": -_share(sum(lp for r in replies or () for lp, _ in r), sum(n for r in replies or () for _, n in r)),
    }


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def reply_logprobs(logprobs: Sequence[float], action_mask: Sequence[int],
                   reply_starts: Sequence[int]) -> list[tuple[float, int]]:
    """Per reply, the sum of its tokens' log-probs and its length. A reply starts at each of
    `reply_starts` (the trajectory's record of them) and runs over generated tokens up to the next
    start (replies may touch: the mask alone cannot tell them apart)."""
    out: list[tuple[float, int]] = []
    for start, stop in zip(reply_starts, [*reply_starts[1:], len(action_mask)]):
        total, n = 0.0, 0
        for i in range(start, stop):
            if not action_mask[i]:
                break
            total, n = total + logprobs[i], n + 1
        out.append((total, n))
    return out


def command_symbol(command: str | None, action: str | None) -> str:
    """One symbol of the edit distance: the admissible command, or the invalid text marked as such."""
    return command if command is not None else f"{INVALID}{action or ''}"


# the stop reasons an env step sets (at the step that ended the episode); every other one
# (env_error, context_full, gate_cut, pruned) is set before a step that never happened
ENDED_BY_STEP = ("won", "lost", "max_steps")


@dataclass(frozen=True)
class Trace:
    """What the signals read of one trajectory: one action symbol (`command_symbol`) and one
    observation per env step taken, the first observation, why it stopped (None: running), and
    per reply (sum of log-probs, tokens) (`reply_logprobs`; one per step where a model replied)."""

    symbols: Sequence[str]
    observations: Sequence[str]
    initial_observation: str
    stop_reason: str | None
    replies: Sequence[tuple[float, int]] = ()

    @classmethod
    def of(cls, traj: Trajectory) -> "Trace":
        """A trajectory as it stands now (during the rollout: its steps so far)."""
        return cls([command_symbol(s.command, s.action) for s in traj.steps], [s.observation for s in traj.steps],
                   traj.initial_observation, traj.stop_reason,
                   reply_logprobs(traj.logprobs, traj.action_mask, traj.reply_starts))

    def finished_by(self, K: int) -> bool:
        """It had finished when step K was taken: it stopped with fewer than K steps, or its step K
        ended it. Read the same from a live trajectory at K and from its finished record (a
        trajectory whose env failed, or whose context filled, after step K had not finished at K).
        A gate cut is the gate's doing, not the trajectory's: never finished."""
        n, why = len(self.symbols), self.stop_reason
        if why is None or why == "gate_cut":
            return False
        return n < K or (n == K and why in ENDED_BY_STEP)


def signals_at(traces: Sequence[Trace], K: int) -> dict[str, float]:
    """The signals of a group at step K (K >= 1) from its trajectories' traces: the action
    prefixes up to K, the observation after step K (the last one of a shorter trajectory; the
    first observation before any step), which had finished by K, and the replies up to K."""
    actions = [list(t.symbols[:K]) for t in traces]
    observations = [t.observations[min(K, len(t.observations)) - 1] if t.observations else t.initial_observation
                    for t in traces]
    return compute_signals(actions, observations, [t.finished_by(K) for t in traces], [list(t.replies[:K]) for t in traces])
