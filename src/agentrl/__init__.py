"""agentrl: GRPO for LLM agents on ALFWorld, with mid-rollout selective gating."""

import os as _os

__version__ = "0.1.0"

# OpenMP's dynamic teams (OMP_DYNAMIC=true: a parallel region gets fewer threads than asked for
# while the machine is loaded) break torch's bf16 CPU matmuls: oneDNN splits a matmul for the
# threads it asked for and the missing threads' share of the output is never written (NaN
# log-probs from the first linear; docs/measurements/evaluation-repeats.md). libgomp reads the
# variable once, when torch loads it, so it is turned off here, before any agentrl module imports
# torch; env workers inherit it. `OMP_DYNAMIC_OVERRIDDEN` keeps what was set, for the CLI's warning.
OMP_DYNAMIC_OVERRIDDEN = None
if _os.environ.get("OMP_DYNAMIC", "").strip().lower() == "true":
    OMP_DYNAMIC_OVERRIDDEN, _os.environ["OMP_DYNAMIC"] = _os.environ["OMP_DYNAMIC"], "false"
