"""The DAPO dynamic-sampling filter as a stage (point: after rollout).

Zero-variance groups (all rewards equal) have A = 0 everywhere and teach nothing: drop them
from the loss. With `select.dapo_refill R`, up to R further rounds of rollouts on fresh tasks
refill the batch toward B groups with variance (DAPO's over-sampling), at the price of the
extra generation, which is counted.
"""

from __future__ import annotations

from agentrl.select.base import StageStats


def _informative(groups: list) -> int:
    return sum(not g.cut and not g.excluded_by for g in groups)


class DapoFilter:
    name = "dapo"
    point = "after"

    def __init__(self, refill: int = 0):
        self.refill = refill
        self.begin(0)

    def begin(self, iteration: int) -> None:
        self._dropped, self._refills, self._refill_groups = [], 0, 0

    def keep(self, groups: list, refill=None, want: int | None = None) -> list:
        """The groups that enter the loss; `refill(n)` rolls out n more tasks (their groups)."""
        kept = self._filter(groups)
        while refill is not None and want and self._refills < self.refill and _informative(kept) < want:
            self._refills += 1
            extra = refill(want - _informative(kept))
            self._refill_groups += len(extra)
            kept += self._filter(extra)
        return kept

    def _filter(self, groups: list) -> list:
        kept = []
        for g in groups:
            if g.cut or g.excluded_by:  # already out of the loss (another stage's decision)
                kept.append(g)
            elif g.zero_variance:
                g.excluded_by = "dapo"
                self._dropped.append(g)
            else:
                kept.append(g)
        return kept

    def observe(self, groups: list) -> None:
        pass

    def stats(self) -> StageStats:
        tokens = sum(g.kept_step_tokens for g in self._dropped)  # ARRoL accounts for what it pruned
        return StageStats({"groups_filtered": len(self._dropped), "refill_rounds": self._refills,
                           "refill_groups": self._refill_groups},
                          step_tokens_generated=tokens, step_tokens_excluded=tokens)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
