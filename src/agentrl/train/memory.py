"""What the learner will hold, known before a run starts: refused in one line when it cannot fit.

The learner's peak is one micro-batch's forward + backward: `learner.micro_batch` rows (or
`learner.tokens_per_microbatch` tokens; auto: one row at least, the rest sized from what is free) of a whole
episode (or, under `prompt.history`, of one step's window), each row's activations saved for
backward, the vocabulary projection of one chunk of positions per row, and the LoRA's weights,
gradients and AdamW moments, on top of the model's weights. Under full fine-tuning (learner.lora_r
0) the model's weights are fp32 master weights (4 bytes a parameter, whatever model.dtype says),
and every parameter has a gradient and two AdamW moments (12 bytes more), plus, with
learner.kl_coef > 0, a frozen fp32 copy of the starting weights (the KL reference): 16 or 20
bytes a parameter (the default model: 2.2 or 2.7 GB) before any activation. On one device with the hf sampler
the sampler's KV cache takes turns with it: the store gives its memory back when a rollout ends,
so the device must hold the larger of the two.

Activations per token, summed over a decoder's layers (LoRA on every linear layer, fp32 on CPU):
the layer's input and norm outputs, q/k/v and their rotated copies, attention output, the MLP's
gate/up/activation/product: about 10 h + 4 kv + 4 i values per layer (h hidden size, kv the
key/value width, i the MLP's width). With gradient checkpointing a layer keeps only its input
(and the hidden state the loss reads), and one layer is recomputed at a time. Measured on the
default model, fp32, 2-core CPU (docs/measurements/learner-memory.md): 1.61 MB per token without checkpointing
(this formula: 1.52) and 0.22 MB with it (0.19); SAFETY covers the difference and the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import UserError
from agentrl.models import load_tokenizer, pick_device, pick_dtype, resolve_model
from agentrl.rollout.plan import expected_context_tokens
from agentrl.sampling.budget import available_memory_bytes
from agentrl.sampling.compat import kv_bytes_per_token, kv_shape, text_config

SAFETY = 1.3
LOGIT_COPIES = 3  # a chunk's fp32 logits, its log-softmax, and their gradient
RESERVE_BYTES = 1 << 30  # Python, torch's own buffers, env workers' share of this machine


def _gb(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


@dataclass
class LearnerMemory:
    weights: int  # the model's weights as loaded (full fine-tuning: in fp32)
    train_state: int  # LoRA weights + gradients + AdamW's two moments (fp32); full: gradients + moments (+ KL reference)
    activations: int  # one micro-batch's saved activations
    logits: int  # one micro-batch's chunk of vocabulary projections
    kv_cache: int  # the hf sampler's KV cache for a rollout on the same device (0 elsewhere), between learner updates
    rows: int
    row_tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.train_state + max(self.activations + self.logits, self.kv_cache)


def activation_bytes_per_token(config, dtype_bytes: int, gradient_checkpointing: bool) -> int:
    """Activations one token keeps for backward across the model (the module docstring's count)."""
    c = text_config(config)
    layers, kv_heads, head_dim = kv_shape(config)
    h, i, kv = c.hidden_size, getattr(c, "intermediate_size", 4 * c.hidden_size), kv_heads * head_dim
    one_layer = 10 * h + 4 * kv + 4 * i
    values = layers * 2 * h + one_layer if gradient_checkpointing else layers * one_layer
    return int(SAFETY * values * dtype_bytes)


def lora_params(config, r: int, target_modules) -> int:
    """Trainable parameters of a LoRA of rank r on these modules of a Llama-style decoder."""
    c = text_config(config)
    layers, kv_heads, head_dim = kv_shape(config)
    h, i = c.hidden_size, getattr(c, "intermediate_size", 4 * c.hidden_size)
    q = c.num_attention_heads * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv_heads * head_dim), "v_proj": (h, kv_heads * head_dim),
              "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return layers * sum(r * sum(shapes.get(m, (h, h))) for m in target_modules)


def model_params(model_name: str, trust_remote_code: bool = False) -> int:
    """The model's parameters (tied ones once), counted on the meta device."""
    from agentrl.models import meta_model

    return sum(p.numel() for p in meta_model(model_name, trust_remote_code).parameters())


def train_state_bytes(cfg, model_config) -> tuple[int, int]:
    """(the learner's weights beyond what is on disk, the state it trains): under full fine-tuning
    fp32 master weights, and per parameter an fp32 gradient, two AdamW moments and, with a KL
    penalty, its frozen reference; else the LoRA's weights, gradients and moments."""
    lc = cfg.learner
    if lc.lora_r:
        return 0, 4 * 4 * lora_params(model_config, lc.lora_r, lc.target_modules)
    n = model_params(cfg.model.name, cfg.model.trust_remote_code)
    return 4 * n, (3 + (1 if lc.kl_coef > 0 else 0)) * 4 * n


def microbatch_rows(lc, row_tokens: int) -> int:
    """Rows of `row_tokens` one micro-batch holds: learner.micro_batch (tokens_per_microbatch null),
    its token budget's worth, or 1 under auto (sized from what is free when it runs: one row must fit)."""
    if lc.tokens_per_microbatch is None:
        return lc.micro_batch
    if lc.tokens_per_microbatch == "auto":
        return 1
    return max(1, lc.tokens_per_microbatch // max(1, row_tokens))


def weight_bytes(model_path: str) -> int:
    """The model's weights: its safetensors (or .bin) files' size on disk."""
    p = Path(model_path)
    files = list(p.glob("*.safetensors")) or list(p.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def microbatch_parts(model_config, dtype_bytes: int, rows: int, tokens: int, row_tokens: int,
                     gradient_checkpointing: bool) -> tuple[int, int]:
    """One micro-batch's (saved activations, vocabulary projection): `tokens` in all over `rows`
    rows of at most `row_tokens`, one chunk of 512 positions a row projected at once."""
    vocab = getattr(text_config(model_config), "vocab_size", 0) or 0
    return (tokens * activation_bytes_per_token(model_config, dtype_bytes, gradient_checkpointing),
            rows * min(512, row_tokens) * vocab * 4 * LOGIT_COPIES)


def microbatch_bytes(*args) -> int:
    """`microbatch_parts` summed: what one micro-batch adds at its peak."""
    return sum(microbatch_parts(*args))


def learner_memory(cfg, t_max: int) -> LearnerMemory:
    """The learner's expected peak for this run's settings (see the module docstring)."""
    import torch
    from transformers import AutoConfig

    path = resolve_model(cfg.model.name)
    model_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    sampler_device = pick_device(cfg.model.device)
    device = cfg.learner.device or sampler_device
    dtype = pick_dtype(cfg.model.dtype, device) if cfg.learner.lora_r else torch.float32  # full FT: fp32 weights
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    history = cfg.prompt.history or 0
    row_tokens = expected_context_tokens(cfg, min(history, t_max) if history else t_max, tokenizer)
    rows = max(1, min(microbatch_rows(cfg.learner, row_tokens),
                      cfg.rollout.tasks * cfg.rollout.group_size * (t_max if history else 1)))
    master, train_state = train_state_bytes(cfg, model_config)
    same_device = device == sampler_device and cfg.sampling.backend == "hf"
    kv = (cfg.rollout.tasks * cfg.rollout.group_size * expected_context_tokens(cfg, t_max, tokenizer)
          * kv_bytes_per_token(model_config, pick_dtype(cfg.model.dtype, sampler_device))) if same_device else 0
    activations, logits = microbatch_parts(model_config, dtype_bytes, rows, rows * row_tokens, row_tokens,
                                           cfg.learner.gradient_checkpointing)
    return LearnerMemory(weights=master or weight_bytes(path), train_state=train_state, activations=activations,
                         logits=logits, kv_cache=kv, rows=rows, row_tokens=row_tokens)


def check_learner_fits(cfg, t_max: int) -> LearnerMemory | None:
    """Refuse, with one line and before anything is written, a run whose learner is expected to
    need more memory than its device has free (ALFWorld runs; vLLM beside it on one GPU: vLLM's budget decides)."""
    import torch

    device = cfg.learner.device or pick_device(cfg.model.device)
    if cfg.env.kind != "alfworld":  # the expected episode length is ALFWorld's (as the KV check's)
        return None
    if cfg.sampling.backend != "hf" and device == pick_device(cfg.model.device):
        return None
    if str(device).startswith("cuda") and not torch.cuda.is_available():  # the device check that follows says so
        return None
    m = learner_memory(cfg, t_max)
    free = available_memory_bytes(torch.device(device)) - (RESERVE_BYTES if not str(device).startswith("cuda") else 0)
    if m.total <= free:
        return m
    gc = cfg.learner.gradient_checkpointing
    per_row = m.activations // m.rows + m.logits // m.rows
    hints = []
    if m.rows > 1 and cfg.learner.tokens_per_microbatch is None:
        hints.append(f"a smaller learner.micro_batch (--micro-batch; each row ~{_gb(per_row)} GB, the gradient is the same)")
    elif m.rows > 1:
        hints.append(f"a smaller learner.tokens_per_microbatch, or auto (each row ~{_gb(per_row)} GB, the gradient is the same)")
    if not gc:
        hints.append("learner.gradient_checkpointing: true (--gradient-checkpointing; activations ~1/8, a second forward's compute)")
    hints.append("a shorter env.max_steps" + (" or prompt.history" if not cfg.prompt.history else ""))
    raise UserError(
        f"train's learner: {m.rows} {'row' if m.rows == 1 else 'rows'} x ~{m.row_tokens} tokens per micro-batch need "
        f"~{_gb(m.activations + m.logits)} GB of activations, ~{_gb(m.total)} GB with the model and "
        + ("LoRA state" if cfg.learner.lora_r else f"full fine-tuning's fp32 weights, gradients and AdamW moments "
           f"(~{_gb(m.weights + m.train_state)} GB)")
        + f", over the {_gb(max(0, free))} GB free on {device}; try " + ", or ".join(hints))


# ---------------------------------------------------------------- the heap an update reuses (CPU)
# A CPU update's peak inside procmem.reused_heap(), above the loaded model, over this module's
# estimate of its largest micro-batch (activations and logits), without / with gradient
# checkpointing: glibc's heap keeps freed blocks and fragments where the fixed threshold unmaps them.
# Measured (docs/measurements/learner-memory.md): 1.18 (fp32, 2 rows x 2,048 random ids), 1.22 and
# 1.50 (a real GRPO update of 8 trajectories, fp32 and bf16: the LoRA's and the loss's fp32 tensors
# do not halve with the base); 3.06 with checkpointing (fp32). Rounded up.
REUSED_HEAP_PEAK = {False: 1.6, True: 4.0}


def reused_heap_fits(peak_bytes: int, gradient_checkpointing: bool, device) -> bool:
    """Whether an update whose largest micro-batch is estimated at `peak_bytes` (`microbatch_bytes`)
    can reuse the heap: on a CPU, where that estimate times the heap's fragmentation fits the
    memory available now, less RESERVE_BYTES. Elsewhere the fixed threshold keeps the peak the run's
    check (`check_learner_fits`) was made for."""
    import torch

    device = torch.device(device)
    if device.type != "cpu":
        return False
    return peak_bytes * REUSED_HEAP_PEAK[gradient_checkpointing] <= available_memory_bytes(device) - RESERVE_BYTES


# ---------------------------------------------------------------- the learner's token budget
MAX_TOKENS_PER_MICROBATCH = 1 << 16  # beyond this a bigger forward buys no speed, only a longer wait
CUDA_HEADROOM = 0.8  # of the free memory: the allocator's fragmentation, cuBLAS/attention workspaces


def loss_bytes_per_token(config) -> int:
    """The vocabulary projection's share per token: a position's fp32 logits, their log-softmax
    and gradient (LOGIT_COPIES), as if every position were projected at once (sft projects the
    reply positions only, the GRPO loss chunks of 512 positions: both less)."""
    vocab = getattr(text_config(config), "vocab_size", 0) or 0
    return 4 * LOGIT_COPIES * vocab


def tokens_per_microbatch(setting, model, device, gradient_checkpointing: bool) -> int | None:
    """`learner.tokens_per_microbatch` as a number: N as given; None (null) as given (micro-batches
    of learner.micro_batch rows); auto: what the device's free memory holds, now (CUDA: free +
    what torch has cached, x CUDA_HEADROOM; CPU: available memory less RESERVE_BYTES), over the
    activations and loss bytes one token needs, conservatively (SAFETY), capped at
    MAX_TOKENS_PER_MICROBATCH. The weights and LoRA state are already allocated, so not counted."""
    import torch

    if setting != "auto":
        return setting
    device = torch.device(device)
    if device.type == "cuda":
        free = available_memory_bytes(device) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = int(free * CUDA_HEADROOM)
    else:
        free = available_memory_bytes(device) - RESERVE_BYTES
    dtype_bytes = model.get_input_embeddings().weight.element_size()  # the base's: what the activations are held in
    per_token = activation_bytes_per_token(model.config, dtype_bytes, gradient_checkpointing) + loss_bytes_per_token(model.config)
    return max(64, min(MAX_TOKENS_PER_MICROBATCH, free // per_token))
