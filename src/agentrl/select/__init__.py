"""Rollout-selection stages (see base.py for the protocol) and the `--select` list."""

from __future__ import annotations

from agentrl.select.base import POINTS, Stage, StageStats
from agentrl.specs import STAGES, check_select, pilot_count, stage_names  # parsed at the bottom layer

__all__ = ["POINTS", "STAGES", "Stage", "StageStats", "check_select", "pilot_count", "stage_names"]
