"""Training: advantage estimators (the learner and loop arrive with the trainer issue)."""
