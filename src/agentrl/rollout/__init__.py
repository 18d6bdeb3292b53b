"""Rollouts: trajectory records, the lockstep runner (all groups step together), signals. The gate's
rule is a selection stage (`agentrl.select.cut`, `agentrl.select.gate_rule`)."""

from agentrl.rollout.lockstep import Group, ModelPolicy, Rollout, RolloutStats, WalkthroughPolicy, merge_rollouts, run_in_slices, run_lockstep
from agentrl.rollout.signals import SIGNALS, compute_signals
from agentrl.rollout.trajectory import Step, Trajectory

__all__ = [
    "SIGNALS", "Group", "ModelPolicy", "Rollout", "RolloutStats", "Step", "Trajectory",
    "WalkthroughPolicy", "compute_signals", "merge_rollouts", "run_in_slices", "run_lockstep",
]
