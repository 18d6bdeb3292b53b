"""The process's heap on Linux (glibc): give freed tensors back to the system.

glibc serves an allocation above its mmap threshold with a private mmap, returned to the system
at free, and smaller ones from the heap, which it keeps. The threshold is dynamic: each time a
mmapped block is freed it rises to that block's size (up to 32 MiB), after which torch's
activations, a few MiB each, come from the heap and stay there, fragmented. Measured on the
2-core CPU (docs/measurements/learner-memory.md): one learner forward + backward of a 2,048-token episode
peaked at 6.1 GB RSS with the dynamic threshold and 3.9 GB with a fixed one (2.5 GB and 1.0 GB
with gradient checkpointing), and the RSS it left behind stayed with the process through the
next rollout. A fixed threshold (glibc's `mallopt(M_MMAP_THRESHOLD)`, or the
MALLOC_MMAP_THRESHOLD_ variable child processes read at start) keeps large tensors in mmap.

`AGENTRL_MALLOC=glibc` leaves glibc's default alone; a MALLOC_MMAP_THRESHOLD_ the user set wins.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD_BYTES = 128 * 1024  # glibc's initial threshold, now fixed
ENV = "MALLOC_MMAP_THRESHOLD_"


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process and the processes it starts; True if set here."""
    if os.environ.get("AGENTRL_MALLOC") == "glibc" or sys.platform != "linux":
        return False
    os.environ.setdefault(ENV, str(THRESHOLD_BYTES))  # env workers and a learner process read it at their start
    try:
        libc = ctypes.CDLL("libc.so.6")
        threshold = int(os.environ[ENV])
    except (OSError, ValueError):  # not glibc (musl), or the user's value is not a number: leave it
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
