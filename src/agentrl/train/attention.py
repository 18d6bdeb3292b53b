"""The learner's attention on a CPU: agentrl's kernel (sampling/cpu_attention.c) forward and
backward, in place of SDPA's (`learner.attention`).

Why: SDPA's CPU flash kernel runs the learner's attention at ~70-150 GFLOP/s forward and backward,
bf16 no faster than fp32, on the 2-core workplace CPU whose bf16 matmuls run at ~300-370; in the
warm start's steps (`agentrl sft`) attention was a third of the CPU time (7.3 of 21.8 s: forward
2.3, backward 5.0). And a packed row (several sequences, each attending to itself: packing.py)
reaches SDPA as a block-diagonal mask, whose every (query, key) pair it computes; the kernel skips
each block of 16 keys that no query of a tile sees. The kernel's forward is the sampler's prefill
(every query of a tile against the visible blocks, bf16 through AVX512-BF16's pair products) that
also writes each query's log-sum-exp; its backward recomputes the scores from it (dQ, dK, dV with
fp32 sums; each (row, KV head) split between two tasks whose dK, dV sums are added at the end, so
no result depends on the thread count).

`learner_attention` is registered with transformers' AttentionInterface as "agentrl_learner",
and with its AttentionMaskInterface as SDPA's mask (so packed position ids still make the
block-diagonal mask); `use_kernel(model)` points the model's config at it. It takes what the
kernel takes (a CPU, fp32 or bf16, head size 64 or 128, a boolean mask or none: the causal one is
made) and hands anything else, dropout included, to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from agentrl.sampling import cpu_attention
from agentrl.sampling.attention import cpu_kernel_for
from agentrl.sampling.compat import kv_shape, text_config

LEARNER_ATTENTION = "agentrl_learner"


class _KernelOut(Exception):
    """The kernel declined a call it was offered (memory): SDPA runs it instead."""


class KernelAttention(torch.autograd.Function):
    """out = attention(q, k, v, mask) through the kernel, its backward through the kernel's."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        res = cpu_attention.forward(q, k, v, mask, scale)
        if res is None:
            raise _KernelOut
        out, lse = res
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grads = cpu_attention.backward(q, k, v, mask, out, lse, dout, ctx.scale)
        if grads is None:
            raise MemoryError("the CPU attention kernel's backward could not allocate its buffers")
        return (*grads, None, None)


def causal_mask(b: int, m: int, L: int) -> torch.Tensor:
    """[b, 1, m, L]: query i (the last m positions of L) sees keys 0 .. L - m + i (made once per
    shape: every layer of a forward asks for the same one)."""
    return _causal(m, L).expand(b, 1, m, L)


@functools.lru_cache(maxsize=8)
def _causal(m: int, L: int) -> torch.Tensor:
    return torch.arange(L)[None, :] <= torch.arange(L - m, L)[:, None]


def learner_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention function (query [b, Hq, M, D], key/value [b, Hkv, L, D]) through the
    kernel where it takes the call, else SDPA's (see the module's docstring)."""
    mask = attention_mask
    if mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        mask = causal_mask(query.shape[0], query.shape[2], key.shape[2])
    if torch.is_autocast_enabled(query.device.type):  # SDPA runs in autocast's dtype (RoPE hands it fp32 q, k)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    b, _, m, _ = query.shape
    if (dropout == 0.0 and mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[0] in (1, b) and tuple(mask.shape[2:]) == (m, key.shape[2]) and query.device.type == "cpu"):
        mask = mask.expand(b, 1, m, key.shape[2])
        if cpu_attention._takes(query, key, value, mask):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            try:
                if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
                    return KernelAttention.apply(query, key, value, mask, scale), None
                out = cpu_attention.prefill(query, key, value, mask, scale)  # the forward's numbers, no log-sum-exp
                if out is not None:
                    return out, None
            except _KernelOut:
                pass
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(LEARNER_ATTENTION, learner_attention)
AttentionMaskInterface.register(LEARNER_ATTENTION, sdpa_mask)


def kernel_for(name: str, device, dtype: torch.dtype, config) -> bool:
    """Whether the learner's attention runs the kernel (`learner.attention`; `dtype`: what its
    forward computes in, autocast's where on): auto = on a CPU where the kernel takes the model's
    dtype and head size; kernel = there or a one-line refusal; sdpa = never."""
    head_dim = kv_shape(config)[2]
    return cpu_kernel_for("learner.attention", "learner", name, "auto", device,
                          lambda: cpu_attention.prefill_unavailable(dtype, head_dim))


def use_kernel(model) -> None:
    """The model's attention (outside the sampler's calls, which set their own and restore this)
    becomes `learner_attention`."""
    text_config(model.config)._attn_implementation = LEARNER_ATTENTION
