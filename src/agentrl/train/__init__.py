"""Training: the loop (`loop._loop`: select, rollout, gate, advantage, learn, swap, eval), the
advantage estimators (GRPO, GiGPO), the loss, the LoRA learner (in this process, its own
process or a Ray actor), checkpoints, the warm start (`sft`) and Tier 2 (`offpolicy`)."""
