"""The sampler's attention on a CPU: a small C kernel (cpu_attention.c), built once per machine
with the system's C compiler and called through ctypes, for a decode step
(`sampling.decode_attention`) and for a prefill (`sampling.prefill_attention`).

Why, a decode step: it attends G query heads of each KV head over a row's whole context, which on
a CPU is memory traffic: K and V read once. SDPA's CPU kernel runs it as small GEMMs over blocks of
keys and is held by compute, not by memory (2-core workplace CPU, 48 rows × 2,048 keys × 30
layers: ~16 GB/s in fp32 and ~8 in bf16, against ~29 GB/s of reads); at `make train`'s context
lengths it was 44% of an eval's generate time. The kernel reads each unmasked key's K and V once,
skips masked keys, and runs at the memory's speed: 2.4x SDPA's in fp32, 5x in bf16 at 48 rows x
2,048 keys (benchmarks/bench_decode_attention.py; docs/measurements/sampler.md).

Why, a prefill (a turn's observation, forced tokens, a first prompt: M new tokens a row): it is
compute, and SDPA's CPU flash kernel runs it at ~100 GFLOP/s in bf16, slower than in fp32, where
this CPU's bf16 matmuls run at ~300. The kernel packs K and V once per (row, KV head) for AVX-512
(AVX512-BF16's pair products in bf16), skips blocks of 16 keys no query of a tile sees, and runs
the same shapes 2.5-3.6x faster in bf16 (benchmarks/bench_prefill_attention.py).

Building: `cc -O3 -march=native -ffast-math -fopenmp` (libmvec's vector expf), linked against the
libgomp torch loaded (one OpenMP thread team: see cpu_attention.c), into the cache root
(`kernels/cpu-attention-<hash>.so`, the hash over the source, the flags, the compiler's version
and the CPU's flags, so a home shared by two machines never loads the other's build), written
atomically; ~1 s once. Where no compiler is found or the build fails, `load()` says why and the
sampler runs SDPA (`auto`), or refuses to start (`kernel`).

The contracts (tests/test_cpu_attention.py holds them against SDPA), both returning SDPA's
attention in q's dtype (fp32 to ~1e-6; bf16 to its rounding), zeros for a query with no unmasked
key (as SDPA's CPU kernels give), or None for what the kernel does not take (another dtype or
device, ...), where the caller runs SDPA:
- `decode(q, k, v, mask, scale)`: q [b, Hkv, G, D] (a decode step's query heads folded per KV
  head), k/v [b, Hkv, L, D] (views of the slot store: any strides with a contiguous last
  dimension), mask [b, 1, 1, L] boolean; returns [b, Hkv, G, D]; None for G > 16, D > 256.
- `prefill(q, k, v, mask, scale)`: q [b, Hkv * G, M, D] (the model's query heads, query head j
  reading KV head j // G), k/v as above, mask [b, 1, M, L] boolean; returns [b, M, Hkv * G, D]
  (the layout the model reads next); None for D other than 64 and 128, G > 16, a CPU without
  AVX-512 (bf16: without AVX512-BF16).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from agentrl.io import atomic_path, cache_root

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
MAX_G, MAX_D = 16, 256  # the C kernel's stack buffers (cpu_attention.c)
PREFILL_D = (64, 128)  # the prefill's head sizes (its accumulators in registers)


class Kernels(NamedTuple):
    """The built kernel's two C functions (cpu_attention.c)."""

    decode: Callable[..., int]
    prefill: Callable[..., int]
    prefill_supported: Callable[[int], int]
    forward: Callable[..., int]  # the learner's: the prefill's attention and each query's log-sum-exp
    backward: Callable[..., int]


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _torch_gomp() -> str | None:
    """The OpenMP runtime torch runs on (its wheel's own libgomp), as loaded in this process: the
    kernel is linked against that very file, so loading it adds no second runtime (whose threads
    would contend with torch's on few cores); None where none is loaded (the compiler's own is linked)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if Path(path).name.startswith("libgomp") and ".so" in path:
                return path
    except OSError:
        pass
    return None


def _link_flags() -> list[str]:
    gomp = _torch_gomp()
    return ["-shared", gomp, "-lm"] if gomp else ["-shared", "-fopenmp", "-lm"]


def _build_key(cc: str, link: list[str]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {cc} does not run: {e}") from None
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + link).encode(), version.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(cc: str, link: list[str], target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the CPU attention kernel into {target.parent}: {e}") from None
    try:
        # written atomically: a concurrent build of the same key writes the same file
        with atomic_path(target, directory=False) as tmp:
            obj = tmp.with_name(f"{tmp.name}.o")
            try:
                # compiled and linked apart: linking with -fopenmp would add the compiler's libgomp
                for command in ([cc, *FLAGS, "-c", str(SOURCE), "-o", str(obj)], [cc, str(obj), *link, "-o", str(tmp)]):
                    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                    if done.returncode != 0:
                        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
                        raise KernelUnavailable(f"{cc} could not build {SOURCE.name}: {first}")
            finally:
                obj.unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} could not build {SOURCE.name}: {e}") from None


@functools.lru_cache(maxsize=1)
def load():
    """The kernel's C functions (`.decode`, `.prefill`), built first if this machine has no build
    of them yet. Raises KernelUnavailable (one line) where they cannot be had."""
    if platform.system() != "Linux":
        raise KernelUnavailable(f"the CPU attention kernel is built for Linux only, not {platform.system()}")
    cc = _compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc, gcc or $CC) to build the CPU attention kernel")
    link = _link_flags()
    target = cache_root() / "kernels" / f"cpu-attention-{_build_key(cc, link)}.so"
    if not target.exists():
        _build(cc, link, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelUnavailable(f"the CPU attention kernel {target} does not load: {e}") from None
    for fn in (lib.agentrl_decode_attention, lib.agentrl_prefill_attention):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 5 + [ctypes.c_float, ctypes.c_int,
                                                                                  ctypes.c_int]
    lib.agentrl_prefill_supported.restype = ctypes.c_int
    lib.agentrl_prefill_supported.argtypes = [ctypes.c_int]
    lib.agentrl_attention_forward.restype = ctypes.c_int
    lib.agentrl_attention_forward.argtypes = [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 6 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.agentrl_attention_backward.restype = ctypes.c_int
    lib.agentrl_attention_backward.argtypes = [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 10 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return Kernels(lib.agentrl_decode_attention, lib.agentrl_prefill_attention, lib.agentrl_prefill_supported,
                   lib.agentrl_attention_forward, lib.agentrl_attention_backward)


def available() -> str | None:
    """None where the kernel is ready; else why not, in one line."""
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None


def prefill_unavailable(dtype: torch.dtype, head_dim: int) -> str | None:
    """None where the prefill kernel runs a model of this dtype and head size here; else why not,
    in one line."""
    why = available()
    if why is not None:
        return why
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the prefill kernel runs fp32 and bf16, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in PREFILL_D:
        return f"the prefill kernel runs head sizes {' and '.join(map(str, PREFILL_D))}, not {head_dim}"
    if not load().prefill_supported(int(dtype == torch.bfloat16)):
        need = "AVX-512 with AVX512-BF16" if dtype == torch.bfloat16 else "AVX-512"
        return f"the prefill kernel needs a CPU with {need}"
    return None


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor | None:
    """SDPA(q, k, v, mask) for one decode step (the module's contract), or None where the kernel
    does not take the call."""
    b, h, g, d = q.shape
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype
            or v.dtype != q.dtype or g > MAX_G or d > MAX_D or k.shape[:2] != (b, h) or v.shape != k.shape
            or mask.dtype != torch.bool or mask.numel() != b * k.shape[2]):
        return None
    L = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    m = mask.reshape(b, L)
    if m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.empty((b, h, g, d), dtype=q.dtype)
    shape = (ctypes.c_int64 * 18)(b, h, g, d, L, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], m.stride(0),
                                  *out.stride()[:3])
    rc = load().decode(shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr(), out.data_ptr(), float(scale),
                int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out if rc == 0 else None


def _takes(q, k, v, mask) -> bool:
    """Whether the prefill kernel (and the learner's) takes these inputs (the module's contract)."""
    b, hq, m, d = q.shape
    h = k.shape[1]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype
            and v.dtype == q.dtype and d in PREFILL_D and hq % h == 0 and hq // h <= MAX_G and k.shape[0] == b
            and k.shape[3] == d and v.shape == k.shape and mask is not None and mask.dtype == torch.bool
            and mask.numel() == b * m * k.shape[2])


def _shape(q, k, v, msk, out) -> ctypes.Array:
    b, hq, m, d = q.shape
    h, L = k.shape[1], k.shape[2]
    return (ctypes.c_int64 * 20)(b, h, hq // h, m, d, L, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                 *msk.stride()[:2], *out.stride()[:3])


def _inputs(q, k, v, mask):
    b, _, m, _ = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    msk = mask.reshape(b, m, k.shape[2])
    return q, k, v, msk if msk.stride(-1) == 1 else msk.contiguous()


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor | None:
    """SDPA(q, k, v, mask) of a prefill's M query positions, in the layout [b, M, Hq, D] (the
    module's contract), or None where the kernel does not take the call."""
    if not _takes(q, k, v, mask):
        return None
    q, k, v, msk = _inputs(q, k, v, mask)
    b, hq, m, d = q.shape
    out = torch.empty((b, m, hq, d), dtype=q.dtype)
    rc = load().prefill(_shape(q, k, v, msk, out), q.data_ptr(), k.data_ptr(), v.data_ptr(), msk.data_ptr(),
                        out.data_ptr(), float(scale), int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out if rc == 0 else None


def forward(q, k, v, mask, scale: float):
    """The learner's forward: (out [b, M, Hq, D], lse [b, Hq, M] fp32), each query's log-sum-exp of
    its scaled scores (-1e30 where it sees no key), or None where the kernel does not take it."""
    if not _takes(q, k, v, mask):
        return None
    q, k, v, msk = _inputs(q, k, v, mask)
    b, hq, m, d = q.shape
    out = torch.empty((b, m, hq, d), dtype=q.dtype)
    lse = torch.empty((b, hq, m), dtype=torch.float32)
    rc = load().forward(_shape(q, k, v, msk, out), q.data_ptr(), k.data_ptr(), v.data_ptr(), msk.data_ptr(),
                        out.data_ptr(), lse.data_ptr(), float(scale), int(q.dtype == torch.bfloat16),
                        torch.get_num_threads())
    return (out, lse) if rc == 0 else None


def backward(q, k, v, mask, out, lse, dout, scale: float):
    """dq [b, Hq, M, D] (a view of [b, M, Hq, D]), dk, dv [b, Hkv, L, D] of `forward`'s attention
    given dout, the gradient of its output [b, M, Hq, D]; None where the kernel does not take it."""
    q, k, v, msk = _inputs(q, k, v, mask)
    dout = dout.contiguous()
    b, hq, m, d = q.shape
    dq = torch.empty((b, m, hq, d), dtype=q.dtype)
    dk = torch.empty(k.shape, dtype=q.dtype)
    dv = torch.empty(k.shape, dtype=q.dtype)
    rc = load().backward(_shape(q, k, v, msk, out), q.data_ptr(), k.data_ptr(), v.data_ptr(), msk.data_ptr(),
                         out.data_ptr(), dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                         float(scale), int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return (dq.transpose(1, 2), dk, dv) if rc == 0 else None
