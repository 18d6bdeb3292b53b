"""Model compatibility: which decoder configs the slot engine serves exactly, and their KV shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.errors import UserError

if TYPE_CHECKING:
    import torch

# model types whose attention the engine serves exactly (transformers' own code, full causal
# attention through the attention interface, a standard per-layer KV): tested on each
SERVED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder config."""
    c = text_config(config)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers, heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token holds across all layers."""
    import torch  # torch: not at import (the CLI imports this module via rollout/plan.py)

    layers, heads, head_dim = kv_shape(config)
    return 2 * layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def servable_length(config) -> int | None:
    """The longest sequence the engine serves exactly (None: no limit), or a UserError for a model
    it cannot serve. A sliding window equals full attention below its size, so it caps the length."""
    c = text_config(config)
    kind = getattr(c, "model_type", None)
    if kind not in SERVED_MODEL_TYPES:
        raise UserError(f"the transformers sampler serves model types {', '.join(SERVED_MODEL_TYPES)}; "
                        f"this model is {kind!r} (use --sampler vllm on a GPU, or one of those models)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, name, None):
            raise UserError(f"the transformers sampler cannot serve {name} (model type {kind!r})")
    limit = getattr(c, "max_position_embeddings", None)
    window = getattr(c, "sliding_window", None)
    sliding = window and (getattr(c, "use_sliding_window", kind == "mistral")
                          or "sliding_attention" in (getattr(c, "layer_types", None) or ()))
    if sliding:
        limit = min(limit or window, window)
    return limit
