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

The fixed threshold's price is the kernel's: every freed block is unmapped and the next one
faulted in afresh (a 12-game warm start: 31.5 M page faults and 67 s of kernel CPU beside 128 s
of its own; inside `reused_heap()` 6.3 M and 13 s). Where a phase's memory is bounded by
something other than the heap, `reused_heap()` lets its transient tensors (up to 32 MiB) come
from the heap and be reused, and gives the freed heap back at the end (`malloc_trim`): the
sampler's generate calls (the KV store is allocated once and is mmapped either way), the warm
start's steps (a micro-batch of at most sft.token_budget tokens, no checkpointing), and a CPU
learner's update where its estimated peak on the reused heap fits what is free (learner.heap auto).

`AGENTRL_MALLOC=glibc` leaves glibc's default alone; a MALLOC_MMAP_THRESHOLD_ the user set wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
THRESHOLD_BYTES = 128 * 1024  # glibc's initial threshold, now fixed
ENV = "MALLOC_MMAP_THRESHOLD_"
REUSED_BYTES = 32 << 20  # glibc's largest dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_BYTES = 128 * 1024  # glibc's default trim threshold: a free top of the heap above it is returned at once
_fixed: dict = {}  # set by return_freed_memory: {"libc": CDLL, "threshold": bytes}


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
    if not libc.mallopt(M_MMAP_THRESHOLD, threshold):
        return False
    _fixed.update(libc=libc, threshold=threshold)
    return True


@contextlib.contextmanager
def reused_heap():
    """Within: allocations up to 32 MiB come from the heap and are reused (no fault per tensor); at
    the end the fixed threshold is back and the heap's free pages go back to the system. Does
    nothing where the threshold was not fixed here (AGENTRL_MALLOC=glibc, not glibc, not Linux).
    Nests: only the outermost block switches and gives back."""
    libc = _fixed.get("libc")
    outer = libc is not None and not _fixed.get("depth")
    _fixed["depth"] = _fixed.get("depth", 0) + 1
    if outer:  # the free top of the heap is kept too (else a freed top block is returned, then faulted in again)
        libc.mallopt(M_MMAP_THRESHOLD, REUSED_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * REUSED_BYTES)
    try:
        yield
    finally:
        _fixed["depth"] -= 1
        if outer:
            libc.mallopt(M_MMAP_THRESHOLD, _fixed["threshold"])
            libc.mallopt(M_TRIM_THRESHOLD, int(os.environ.get("MALLOC_TRIM_THRESHOLD_", TRIM_BYTES)))
            libc.malloc_trim(0)
