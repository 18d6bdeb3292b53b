"""Memory probing: free memory where the KV store lives, and the KV budget derived from it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# what `auto` leaves to everything else: the learner's model, gradients and optimizer, env workers,
# activations and Python (CPU); activations and the learner (GPU share)
AUTO_RESERVE_BYTES = 3 << 30
AUTO_SHARE = 0.85


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV store lives: MemAvailable (cgroup limit respected) or the GPU's free memory."""
    if device.type == "cuda":
        import torch  # torch: not at import (the CLI imports this module via rollout/plan.py)

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
            used_path = path.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
            if raw != "max" and int(raw) < 1 << 50:
                cg = int(raw) - int(open(used_path).read().strip())
                avail = cg if avail is None else min(avail, cg)
        except (OSError, ValueError):
            pass
    return avail if avail is not None else (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def kv_budget_bytes(value, device: torch.device) -> int:
    """`sampling.kv_budget_gb` in bytes: a number of GB, or auto (free memory less a reserve)."""
    if value not in (None, "auto"):
        return int(float(value) * (1 << 30))
    free = available_memory_bytes(device)
    return max(1 << 28, int(AUTO_SHARE * (free - AUTO_RESERVE_BYTES)))


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The largest resident memory a process has held so far (Linux VmHWM; 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gb(n) -> str:
    return f"{n / (1 << 30):.2f}" if n is not None else "none"
