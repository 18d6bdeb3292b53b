"""OpenMP's dynamic teams are turned off before torch loads libgomp (agentrl/__init__.py): with
OMP_DYNAMIC=true a loaded machine gives a parallel region fewer threads than asked for, and
oneDNN's bf16 matmuls leave the missing threads' outputs unwritten (NaN). The NaN itself needs a
loaded machine (libgomp sizes dynamic teams from the load average), so these tests read libgomp's
own dyn-var, in fresh processes: real torch, real libgomp."""

import os
import subprocess
import sys

# libgomp's dyn-var in a fresh process, after IMPORTS; the libgomp torch loaded is found in the maps
PROBE = """
import ctypes
{imports}
path = next(l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l.split()[-1])
print(ctypes.CDLL(path).omp_get_dynamic())
"""


def run(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_agentrl_turns_dynamic_teams_off_before_torch_loads_libgomp():
    control = run("-c", PROBE.format(imports="import torch"), OMP_DYNAMIC="true")
    assert control.returncode == 0, control.stderr
    assert control.stdout.strip() == "1"  # the probe sees the variable take effect without agentrl
    out = run("-c", PROBE.format(imports="import agentrl, torch\nassert agentrl.OMP_DYNAMIC_OVERRIDDEN == 'True'"),
              OMP_DYNAMIC="True")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_agentrl_leaves_other_values_alone():
    out = run("-c", "import os, agentrl; print(agentrl.OMP_DYNAMIC_OVERRIDDEN, os.environ['OMP_DYNAMIC'])", OMP_DYNAMIC="false")
    assert out.stdout.split() == ["None", "false"]


def test_the_cli_says_once_that_it_ignored_omp_dynamic():
    out = run("-m", "agentrl.cli", "--help", OMP_DYNAMIC="true")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "OMP_DYNAMIC" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: OMP_DYNAMIC=true ignored"), out.stderr
