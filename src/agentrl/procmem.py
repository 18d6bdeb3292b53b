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

A long `agentrl sft` outgrows glibc's heap either way: its steps' tensors (MiBs, a new size every
step) free into one large bin kept sorted by size, and small allocations that outlive a step pin
the freed space apart, so each malloc walks a list that lengthens all run. Measured on the 2-core
CPU (docs/measurements/sft-allocator.md): a warm start on every train game went from ~10 to 20-24 s
a step within 70 minutes, 37% of its samples in `_int_malloc`. So `agentrl sft` runs under
mimalloc (the cmeel-mimalloc wheel) where it is installed: `exec_allocator()`, called by the CLI's
entry before anything else, starts the command again with the library in LD_PRELOAD, its freed
memory kept for reuse rather than returned (MIMALLOC_PURGE_DELAY=-1: the default 10 ms faulted 1.2 M
pages a minute back in). `AGENTRL_MALLOC=mimalloc` asks for it on any command; `fixed` keeps every
command on glibc with the fixed threshold (what `agentrl sft` ran on before), `glibc` on glibc's
own default. An eval gained nothing from it (minutes long; its generate calls reuse the heap).
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
    """Fix glibc's mmap threshold for this process and the processes it starts; True if set here
    (not under mimalloc, whose malloc glibc's settings do not reach)."""
    if os.environ.get("AGENTRL_MALLOC") == "glibc" or sys.platform != "linux" or allocator() != "glibc":
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


# ---------------------------------------------------------------- the allocator a command runs under
MIMALLOC_COMMANDS = ("sft",)  # measured there (the module's docstring); any command: AGENTRL_MALLOC=mimalloc
CHOICES = ("", "fixed", "glibc", "mimalloc")  # AGENTRL_MALLOC's values ("": mimalloc for sft, else fixed)
EXEC_MARK = "AGENTRL_MALLOC_EXEC"  # set in the command started again: never a second time


def allocator() -> str:
    """The malloc this process runs on: `mimalloc` (preloaded) or `glibc` (anything else)."""
    try:
        return "mimalloc" if hasattr(ctypes.CDLL(None), "mi_version") else "glibc"
    except OSError:
        return "glibc"


def mimalloc_library() -> str | None:
    """The shared library the cmeel-mimalloc wheel installs, or None where it is not installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution("cmeel-mimalloc")
    except metadata.PackageNotFoundError:
        return None
    found = sorted(str(dist.locate_file(f)) for f in dist.files or () if f.name.startswith("libmimalloc.so."))
    return next((f for f in found if os.path.isfile(f)), None)


def allocator_exec(args: list[str], environ, entry: list[str]) -> tuple[list[str], dict] | None:
    """How to start the command `args` (argv less the program) again under mimalloc, through
    `entry` (the argv that starts the CLI), with which environment; None to run as it is: not
    Linux, AGENTRL_MALLOC=fixed or glibc, a command not in MIMALLOC_COMMANDS (unless AGENTRL_MALLOC=mimalloc),
    mimalloc in use already or not installed, or this is the command started again."""
    choice = environ.get("AGENTRL_MALLOC", "")
    command = next((a for a in args if not a.startswith("-")), None)
    if (sys.platform != "linux" or choice in ("fixed", "glibc") or environ.get(EXEC_MARK)
            or (choice != "mimalloc" and command not in MIMALLOC_COMMANDS)):
        return None
    library = mimalloc_library()
    if library is None or allocator() == "mimalloc":
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(filter(None, (library, environ.get("LD_PRELOAD"))))
    env.setdefault("MIMALLOC_PURGE_DELAY", "-1")  # keep freed pages for the next step (no fault per tensor)
    env[EXEC_MARK] = "1"
    return [*entry, *args], env


def exec_allocator(entry: list[str]) -> None:
    """Start this process's command again under mimalloc where `allocator_exec` says so (a process
    cannot change its malloc once running: the CLI's entry points call this first); else return."""
    choice = os.environ.get("AGENTRL_MALLOC", "")
    if choice not in CHOICES:
        sys.exit(f"error: AGENTRL_MALLOC={choice} is not one of {', '.join(filter(None, CHOICES))} (or unset)")
    start = allocator_exec(sys.argv[1:], os.environ, entry)
    if start is not None:
        argv, env = start
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(argv[0], argv, env)
    if choice == "mimalloc" and sys.platform == "linux" and allocator() != "mimalloc":  # asked for, not had
        why = "the cmeel-mimalloc wheel is not installed" if mimalloc_library() is None else "its library did not load"
        print(f"warning: AGENTRL_MALLOC=mimalloc, but {why}: running on glibc", file=sys.stderr)
