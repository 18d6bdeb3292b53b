"""What a result was computed on: the record that makes a number traceable to its numerics.

The same config gives other bits on another machine: `model.dtype: bf16-if-native` runs bf16 on a
CPU with AVX512-BF16 or AMX and fp32 on one without (found on 2026-12-07, when a session's machine
changed from the first kind to an AVX2-only AMD EPYC and its warm start came out with other bytes),
the CPU kernels take other paths by ISA, and bf16 sums follow the thread count. So every eval's
summary.json, every `agentrl rollout`'s, every `agentrl sft` output and every `agentrl train` run
(once per start, resume included) carries `machine(cfg)`: the dtype the run resolved to, the device, the CPU and its ISA,
the threads, the library versions and the code's commit.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from functools import cache
from pathlib import Path

from agentrl import __version__
from agentrl.errors import RunError
from agentrl.models import native_bf16, pick_device, resolved_dtype

__all__ = ["append_machine", "code_commit", "cpu_name", "machine", "numerics"]


@cache
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() is often empty there)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
    except OSError:
        fields = {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    # a VM may show only the brand ("AMD EPYC"): the family and model tell the generation
    return fields["model name"] + (f" (family {fields['cpu family']}, model {fields['model']})" if "cpu family" in fields else "")


@cache
def code_commit() -> str | None:
    """The agentrl checkout's commit, "+dirty" where tracked files differ from it; None outside a
    git checkout (an installed wheel: its version says what it is)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine(cfg=None) -> dict:
    """This process's machine, and the dtype `cfg.model` resolves to on it (a plain dict for JSON)."""
    import torch

    device = pick_device(cfg.model.device if cfg is not None else "auto")
    return {
        **({"dtype": resolved_dtype(cfg.model.dtype, device), "dtype_setting": cfg.model.dtype} if cfg is not None else {}),
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ISA torch's CPU kernels dispatch to
        "cpu_bf16": native_bf16("cpu"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "agentrl": __version__,
        "commit": code_commit(),
        "host": platform.node(),
    }


def numerics(record: dict) -> str:
    """A machine record in the words that decide a result's bits: "float32 on cpu (AVX2)"."""
    where = record.get("device", "?")
    if where == "cpu":
        where = f"cpu ({record.get('cpu_capability', '?')})"
    return f"{record.get('dtype', '?')} on {where}"


def append_machine(path: Path, cfg, **extra) -> None:
    """One line in `path` (a train run's machine.jsonl) for this start of the run: when, and on what."""
    row = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra, **machine(cfg)}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # before the first iteration: nothing of the run is lost
        raise RunError(f"cannot write {path}: {e.strerror or e}") from None
