"""Fault injection, for the reliability tests: make a real `agentrl train` process fail at a
named point of an iteration, the way a user's run fails (a kill -9, a full disk).

    AGENTRL_FAULT=kill:update@2      SIGKILL this process in iteration 2's update
    AGENTRL_FAULT=enospc:checkpoint@2  "No space left on device" while writing checkpoint 2

Points: rollout (after an env step), update (after a backward pass, before the optimizer
step), metrics (the metrics line is written, the checkpoint not yet), checkpoint (its files
are written to the temporary directory, not renamed yet), latest (renamed, the `latest`
pointer not updated yet). Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal

POINTS = ("rollout", "update", "metrics", "checkpoint", "latest")
iteration = 0  # the training iteration in progress (set by the loop)


def point(name: str) -> None:
    spec = os.environ.get("AGENTRL_FAULT")
    if not spec:
        return
    action, _, where = spec.partition(":")
    at, _, it = where.partition("@")
    if at != name or (it and int(it) != iteration):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
