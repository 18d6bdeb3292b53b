"""`python tests/scripted_cli.py ARGS...` is `agentrl ARGS...` whose sampler is the ScriptedSampler
of tests/scripted.py (modes from AGENTRL_SCRIPTED_MODES, comma-separated; default `split`), for
tests that need a real process (kill -9, the CLI) and an event that must happen by construction."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scripted import wrap_make_sampler  # noqa: E402

wrap_make_sampler(tuple(os.environ.get("AGENTRL_SCRIPTED_MODES", "split").split(",")))

from agentrl.cli import main  # noqa: E402  (after the wrap)

main()
