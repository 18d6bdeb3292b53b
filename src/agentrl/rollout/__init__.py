"""Rollouts: trajectory records, the lockstep runner (all groups step together), signals. The gate's
rule is a selection stage (`agentrl.select.cut`, `agentrl.select.gate_rule`)."""

from agentrl.rollout.lockstep import (Group, LockstepConfig, ModelPolicy, Progress, Rollout, RolloutStats, WalkthroughPolicy,
                                      lockstep, merge_rollouts, run_in_slices, run_lockstep)
from agentrl.rollout.signals import SIGNALS, compute_signals
from agentrl.rollout.trajectory import Step, Trajectory

__all__ = [
    "SIGNALS", "Group", "LockstepConfig", "ModelPolicy", "Progress", "Rollout", "RolloutStats", "Step", "Trajectory",
    "WalkthroughPolicy", "compute_signals", "lockstep", "merge_rollouts", "run_in_slices", "run_lockstep",
]
