"""agentrl: GRPO for LLM agents on ALFWorld, with mid-rollout selective gating."""

__version__ = "0.1.0"
