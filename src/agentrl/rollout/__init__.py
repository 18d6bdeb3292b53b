"""Rollouts: trajectory records, the lockstep runner (all groups step together), signals, gate."""

from agentrl.rollout.gate import Gate, parse_gate
from agentrl.rollout.lockstep import (Group, LockstepConfig, ModelPolicy, Progress, Rollout, RolloutStats, WalkthroughPolicy,
                                      lockstep, merge_rollouts, run_in_slices, run_lockstep)
from agentrl.rollout.signals import SIGNALS, compute_signals
from agentrl.rollout.trajectory import Step, Trajectory

__all__ = [
    "SIGNALS", "Gate", "Group", "LockstepConfig", "ModelPolicy", "Progress", "Rollout", "RolloutStats", "Step", "Trajectory",
    "WalkthroughPolicy", "compute_signals", "parse_gate", "lockstep", "merge_rollouts", "run_in_slices", "run_lockstep",
]
