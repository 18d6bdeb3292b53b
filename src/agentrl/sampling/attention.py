"""Which SDPA kernel the sampler's attention runs on (`sampling.attention_backend`), and how big a
prefill forward may be.

`slot_attention` (kv.py) calls `F.scaled_dot_product_attention` with a boolean mask; SDPA then
picks a kernel itself (on an H100: cuDNN first, then flash, efficient, math). Issue 47 measured
cuDNN costing 1.57 ms of host time per call for 0.18 ms of GPU work in the decode step, so the
kernel is a setting: `auto` leaves SDPA's choice, `cudnn | efficient | math | flash` pin one,
only around the sampler's calls (`sdpa_backend`, a context manager: torch's own
`sdpa_kernel`, restored on exit, so the learner sharing the process keeps SDPA's choice).

A pin is checked once, when the sampler is built (`check_backend`): both shapes the sampler runs
(a decode step's folded query rows, a prefill's grouped heads), each with its boolean mask, on
the model's device and dtype. A kernel that cannot run them is refused in one line naming the
device and the kernels that can, before any work starts; never a silent fallback, so a timing
taken under a pin is the pinned kernel's. Flash takes no mask on CUDA, so it is refused there;
on the CPU the fused ("flash") kernel takes one, and is SDPA's own choice.

A decode step and a prefill on a CPU run agentrl's own kernel instead (`sampling.decode_attention`,
`sampling.prefill_attention`; cpu_attention.py) unless SDPA is asked for: `decode_kernel_for` and
`prefill_kernel_for` decide once, when the sampler is built.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from agentrl.config import ATTENTION_BACKENDS as BACKENDS
from agentrl.config import CPU_ATTENTION
from agentrl.errors import UserError

log = logging.getLogger(__name__)

# a prefill forward's transient memory (issue 47, item 4): where attention materialises its
# scores (the math kernel: fp32, every query head), under the cap the engine always had; with a
# fused kernel (no score matrix) the rows' tokens are counted instead: the boolean mask and
# SDPA's additive copy of it (mask bytes per key), and the hidden activations of each token.
SCORE_BYTES = 256 << 20
FUSED_BYTES = 2 << 30


def _sdp(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[name]


def check_name(name: str) -> None:
    if name not in BACKENDS:
        raise UserError(f"sampling.attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")


@contextmanager
def sdpa_backend(name: str):
    """SDPA runs only the named kernel inside the block (`auto`: SDPA's own choice, nothing pinned).
    torch's `sdpa_kernel` restores the previous kernel set on exit, exceptions included."""
    check_name(name)
    if name == "auto":
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdp(name)]):
        yield


def _probe(name: str, device, dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Which of the sampler's two shapes `slot_attention` cannot run under the pin (tiny sizes);
    None when it runs both."""
    import torch

    from agentrl.sampling.kv import slot_attention  # the real call: what the sampler runs

    L, M = 16, 4
    k = torch.zeros((2, kv_heads, L, head_dim), dtype=dtype, device=device)
    keys = torch.arange(L, device=device)
    qpos = torch.arange(L - M, L, device=device)[None].expand(2, M)
    shapes = {"a decode step": (1, (keys[None, None, :] <= torch.tensor([[5], [9]], device=device))[:, None]),
              "a prefill": (M, (keys[None, None, :] <= qpos[:, :, None])[:, None])}  # masks [b, 1, M, L]
    for shape, (m, mask) in shapes.items():
        try:
            with torch.no_grad(), sdpa_backend(name):
                slot_attention(None, torch.zeros((2, heads, m, head_dim), dtype=dtype, device=device), k, k, mask)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except RuntimeError:  # "No available kernel", or a kernel's own refusal of the shape
            return shape
    return None


def _shape(config) -> tuple[int, int, int]:
    from agentrl.sampling.compat import kv_shape, text_config

    _, kv_heads, head_dim = kv_shape(config)
    return text_config(config).num_attention_heads, kv_heads, head_dim


def usable_backends(device, dtype, config) -> list[str]:
    """The pins that run the sampler's attention for a model of `config` on `device` in `dtype`."""
    return [n for n in BACKENDS[1:] if _probe(n, device, dtype, *_shape(config)) is None]


def check_backend(name: str, device, dtype, config) -> str:
    """`name`, once it is known to run the sampler's attention here; else one line naming the
    device, the shape it cannot run and the kernels that can (a UserError: the run stops before
    it starts)."""
    import torch

    check_name(name)
    if name == "auto":
        return name
    device = torch.device(device)
    failed = _probe(name, device, dtype, *_shape(config))
    if failed:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        usable = usable_backends(device, dtype, config)
        raise UserError(f"sampling.attention_backend={name}: SDPA's {name} kernel cannot run the sampler's masked "
                        f"attention ({failed}) on {where} ({device}, {str(dtype).removeprefix('torch.')}); choose auto "
                        f"or one of {', '.join(usable) or 'none'}")
    return name


def materialises_scores(name: str, device, dtype, config) -> bool:
    """Whether a prefill forward's attention builds the score matrix: always on the CPU (the
    engine's rule there stays as it was), under a math pin, and wherever SDPA would pick math
    for the prefill shape (asked of SDPA's own dispatch, without running it)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or name == "math":
        return True
    heads, kv_heads, head_dim = _shape(config)
    q = torch.zeros((2, heads, 64, head_dim), dtype=dtype, device=device)
    k = torch.zeros((2, kv_heads, 128, head_dim), dtype=dtype, device=device)
    mask = torch.ones((2, 1, 64, 128), dtype=torch.bool, device=device)
    try:
        with sdpa_backend(name):
            choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=None, enable_gqa=heads != kv_heads)
    except (RuntimeError, TypeError, AttributeError):  # a private function: when it is gone, the safe answer
        return True
    from torch.nn.attention import SDPBackend

    return SDPBackend(choice) == SDPBackend.MATH


def token_bytes(config, dtype_bytes: int) -> int:
    """A prefill token's hidden activations live at once in one layer (the residual, its norm, q/k/v,
    the attention output; the MLP's gate, up and product), an estimate for sizing forwards."""
    from agentrl.sampling.compat import text_config

    c = text_config(config)
    return (6 * c.hidden_size + 3 * c.intermediate_size) * dtype_bytes


def prefill_fits(rows: int, new: int, kv: int, *, heads: int, scores: bool, mask_bytes: int = 3,
                 per_token: int = 0) -> bool:
    """Whether `rows` rows of `new` new tokens over `kv` keys make one prefill forward.
    `scores`: the attention materialises fp32 scores for every query head (the CPU, math): they stay
    under SCORE_BYTES, as always. Fused kernels: the mask (bool plus SDPA's additive copies,
    `mask_bytes` per query-key pair) and the tokens' activations (`per_token`) stay under
    FUSED_BYTES, so 128 rows of 2k tokens run in a few forwards, not 128."""
    if scores:
        return rows * new * kv * heads * 4 <= SCORE_BYTES
    return rows * new * (kv * mask_bytes + per_token) <= FUSED_BYTES


def prefill_sizer(name: str, device, dtype, config):
    """`fits(rows, new, kv)` for a sampler of this model, device, dtype and pin (prefill_fits's rule)."""
    import functools

    import torch

    from agentrl.sampling.compat import text_config

    size = torch.empty((), dtype=dtype).element_size()
    # mask bytes per query-key pair: the bool mask, SDPA's additive copy, and a padded copy of that
    # (the efficient kernel aligns the key dimension)
    return functools.partial(prefill_fits, heads=text_config(config).num_attention_heads,
                             scores=materialises_scores(name, device, dtype, config), mask_bytes=1 + 2 * size,
                             per_token=token_bytes(config, size))


def cpu_kernel_for(setting: str, what: str, name: str, attention_backend: str, device, unavailable) -> bool:
    """Whether `what` ("decode": decode steps, "prefill": prefills, "learner": the learner's
    attention) runs agentrl's CPU kernel (`setting`, e.g. sampling.decode_attention):
    auto = on a CPU where it runs (`unavailable()` is None) and no SDPA kernel is pinned (a pin asks
    for SDPA's kernel, so a timing under it is SDPA's); kernel = there or a one-line refusal;
    sdpa = never."""
    import torch

    if name not in CPU_ATTENTION:
        raise UserError(f"{setting} must be one of {', '.join(CPU_ATTENTION)}, got {name!r}")
    device = torch.device(device)
    if name == "sdpa" or (name == "auto" and attention_backend != "auto"):
        return False
    if device.type != "cpu":
        if name == "kernel":
            raise UserError(f"{setting}=kernel: agentrl's {what} kernel runs on a CPU, this sampler on "
                            f"{device}; choose auto or sdpa")
        return False
    why = unavailable()
    if why is None:
        return True
    if name == "kernel":
        raise UserError(f"{setting}=kernel: {why}; choose auto or sdpa")
    # a decode step says why as a warning (a compiler is the fix); a prefill's reasons beyond the
    # decode step's (a dtype, a head size, a CPU it does not take) are nothing to fix: said as info
    level = logging.WARNING if what == "decode" else logging.INFO
    log.log(level, "%s run SDPA's attention: %s",
            {"decode": "decode steps", "learner": "the learner's forwards"}.get(what, f"{what}s"), why)
    return False


def decode_kernel_for(name: str, attention_backend: str, device) -> bool:
    """Whether the sampler's decode steps run agentrl's CPU kernel (`sampling.decode_attention`)."""
    from agentrl.sampling import cpu_attention

    return cpu_kernel_for("sampling.decode_attention", "decode", name, attention_backend, device, cpu_attention.available)


def prefill_kernel_for(name: str, attention_backend: str, device, dtype, config) -> bool:
    """Whether the sampler's prefills run agentrl's CPU kernel (`sampling.prefill_attention`): as
    decode_kernel_for, where the kernel takes the model's dtype and head size on this CPU."""
    from agentrl.sampling import cpu_attention
    from agentrl.sampling.compat import kv_shape

    head_dim = kv_shape(config)[2]
    return cpu_kernel_for("sampling.prefill_attention", "prefill", name, attention_backend, device,
                           lambda: cpu_attention.prefill_unavailable(dtype, head_dim))
