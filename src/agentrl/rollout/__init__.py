"""Rollouts: trajectory records and the lockstep runner (all trajectories step together)."""

from agentrl.rollout.lockstep import ModelPolicy, RolloutStats, WalkthroughPolicy, run_lockstep
from agentrl.rollout.trajectory import Step, Trajectory

__all__ = ["ModelPolicy", "RolloutStats", "Step", "Trajectory", "WalkthroughPolicy", "run_lockstep"]
