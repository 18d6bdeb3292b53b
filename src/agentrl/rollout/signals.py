"""The seven divergence signals of a group at step K (seed paper, App. B; DESIGN.md).

Each is computed over the G partial trajectories of one task. A trajectory that finished
before K keeps its actual (shorter) prefix; its last action and observation stand for
a_{i,K} and o_{i,K}. All values lie in [0, 1].
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

from rapidfuzz.distance import Levenshtein

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


def compute_signals(actions: list[list[str]], observations: list[str], finished: list[bool]) -> dict[str, float]:
    g = len(actions)
    if g == 0 or len(observations) != g or len(finished) != g:
        raise ValueError("actions, observations and finished need one entry per trajectory (G >= 1)")
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
    }


def command_symbol(command: str | None, action: str | None) -> str:
    """One symbol of the edit distance: the admissible command, or the invalid text marked as such."""
    return command if command is not None else f"invalid:{action or ''}"
