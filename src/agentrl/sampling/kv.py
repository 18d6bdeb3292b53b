"""The slot KV store: one buffer per layer, a slot per live sequence, attention over per-row lengths.

Per layer one key and one value buffer of shape [slots, kv_heads, capacity, head_dim], grown
when a call needs more (one layer at a time, so growing never holds two copies of the store).
Each live sequence (a sampler `key`: one trajectory) owns a slot and a length: its next turn
writes only the new tokens, right after its cached prefix; a released sequence frees its slot
for the next one. Nothing is cloned per row, re-stacked or batch-selected: a batch whose rows
sit in consecutive slots reads the buffer as a view, others gather only the rows they need.

The model code stays transformers' own. The store is a `transformers.Cache` (each attention
layer calls `update` with its new keys and values) and the attention is a function registered
through transformers' `AttentionInterface` ("agentrl_slots"): SDPA over the slot rows with a
mask of per-row lengths built on the device, query heads grouped per KV head, so K and V are
never copied out to every query head (SmolLM2: 3 KV heads serve 9 query heads).

Memory is bounded by a budget (`sampling.kv_budget_gb`, auto: from free memory): past it the
store first drops the caches of sequences the current batch does not need (they are re-run
from their tokens at their next turn: slower, never wrong), and only when one batch alone
cannot fit does it stop the run with one line naming the knobs.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from agentrl.errors import RunError, UserError

log = logging.getLogger(__name__)

ATTENTION = "agentrl_slots"
# model types whose attention the engine serves exactly (transformers' own code, full causal
# attention through the attention interface, a standard per-layer KV): tested on each
SERVED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# a rollout step adds the reply and the next observation: about 52 tokens on ALFWorld (measured:
# ~400 tokens at step 1, ~1.9k at step 30 with the default model); the up-front estimate uses 56
TOKENS_PER_STEP = 56


class KVBudgetError(RunError):
    """One batch of the sampler cannot fit the KV budget: the run stops cleanly (checkpoint intact)."""


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder config."""
    c = text_config(config)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers, heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token holds across all layers."""
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


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV store lives: MemAvailable (cgroup limit respected) or the GPU's free memory."""
    if device.type == "cuda":
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


# what `auto` leaves to everything else: the learner's model, gradients and optimizer, env workers,
# activations and Python (CPU); activations and the learner (GPU share)
AUTO_RESERVE_BYTES = 3 << 30
AUTO_SHARE = 0.85


def kv_budget_bytes(value, device: torch.device) -> int:
    """`sampling.kv_budget_gb` in bytes: a number of GB, or auto (free memory less a reserve)."""
    if value not in (None, "auto"):
        return int(float(value) * (1 << 30))
    free = available_memory_bytes(device)
    return max(1 << 28, int(AUTO_SHARE * (free - AUTO_RESERVE_BYTES)))


# ---------------------------------------------------------------- attention


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of `query` [b, Hq, M, D] over the slot rows `key`/`value` [b, Hkv, L, D] with the
    store's boolean mask [b, 1, M, L]. Query heads are grouped per KV head (a decode step: the g
    query heads of a KV head become g query rows of it; a prefill: SDPA's enable_gqa), so no
    copy of K or V is made for each query head."""
    b, hq, m, d = query.shape
    hkv = key.shape[1]
    if m == 1 and hq != hkv:
        g = hq // hkv
        q = query.reshape(b, hkv, g, d)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask.reshape(b, 1, 1, -1), scale=scaling)
        return out.reshape(b, 1, hq, d), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=hq != hkv)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, slot_attention)


class use_slot_attention:
    """Route the model's attention through `slot_attention` for the duration of a sampler call
    (restored after, so a learner sharing the model keeps its own attention)."""

    def __init__(self, model):
        self.config = text_config(model.config)

    def __enter__(self):
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION

    def __exit__(self, *exc):
        self.config._attn_implementation = self.previous


# ---------------------------------------------------------------- the store


class SlotStore(Cache):
    """Keys and values of every live sequence, one slot each (see the module docstring).

    The sampler drives it: `reusable` (how much of a prompt a key has cached), `place` (slots for
    a batch, packed into consecutive slots when possible, capacity grown, the budget kept),
    `begin` (what the next forward writes and reads), `hold` (what a key now holds), `release`.
    """

    def __init__(self, config, dtype: torch.dtype, device: torch.device, budget_bytes: int | None = None,
                 grow_tokens: int = 128):
        super().__init__(layers=[])
        self.n_layers, self.kv_heads, self.head_dim = kv_shape(config)
        self.dtype, self.device = dtype, torch.device(device)
        self.bytes_per_token = kv_bytes_per_token(config, dtype)
        self.budget = budget_bytes
        self.grow_tokens = grow_tokens
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0  # rows of every buffer
        self.capacity = 0  # token positions of every row
        self.owner: list = []  # slot -> key, None when free
        self.slot_of: dict = {}  # key -> slot
        self.ids: dict = {}  # key -> the token ids whose keys and values its slot holds
        self.used: dict = {}  # key -> the call that last used it (drop order under memory pressure)
        self.calls = 0
        self.moves = 0  # rows moved to pack a batch into consecutive slots
        self.dropped = 0  # caches dropped under the budget (re-run at their next turn)
        self.peak_bytes = 0
        self._warned = False
        self._fwd = None

    # ------------------------------------------------------------ size

    @property
    def nbytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token

    @property
    def live(self) -> int:
        return len(self.slot_of)

    def _resize(self, slots: int, capacity: int) -> None:
        """New buffers of [slots, H, capacity, D], layer by layer (the old layer is freed before the next
        is made, so the peak is the store plus one layer). Rows and positions beyond the new size are dropped."""
        if slots == self.slots and capacity == self.capacity:
            return
        if slots == 0 or capacity == 0:
            self.k, self.v = [], []
        else:
            keep_s, keep_c = min(slots, self.slots), min(capacity, self.capacity)
            for layer in range(self.n_layers):
                for bufs in (self.k, self.v):
                    # zeros, not empty: a masked position still multiplies its value by 0, and 0 * NaN is NaN
                    new = torch.zeros((slots, self.kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device)
                    if layer < len(bufs):
                        if keep_s and keep_c:
                            new[:keep_s, :, :keep_c] = bufs[layer][:keep_s, :, :keep_c]
                        bufs[layer] = new
                    else:
                        bufs.append(new)
        self.owner = (self.owner + [None] * slots)[:slots]
        self.slots, self.capacity = slots, capacity
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    # ------------------------------------------------------------ keys

    def reusable(self, key, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` the key's slot already holds (0: none): its common
        prefix with what the slot holds (a turn continuing the last: all of it; a prompt.history
        window: the opening), at least one token left to run. Keys and values at a position
        depend only on the tokens up to it, so the shared prefix's are valid as they are; the
        rest of the slot is overwritten from there."""
        held = self.ids.get(key)
        if not held:
            return 0
        if len(held) < len(prompt) and prompt[: len(held)] == held:
            return len(held)
        n = 0
        for a, b in zip(held, prompt):
            if a != b:
                break
            n += 1
        return min(n, len(prompt) - 1)

    def hold(self, key, ids: list[int]) -> None:
        """The key's slot now holds the keys and values of exactly `ids`."""
        self.ids[key] = ids

    def release(self, keys) -> None:
        for key in keys:
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self.owner[slot] = None
            self.ids.pop(key, None)
            self.used.pop(key, None)
        if not self.slot_of:  # nothing live: give the memory back (the learner may want it)
            self._resize(0, 0)

    def stale(self) -> list:
        """Keys that missed the last two calls (for callers that never release; the rollout's two
        waves take turns, so a key missing one call is still live)."""
        return [k for k, c in self.used.items() if self.calls - c >= 3]

    # ------------------------------------------------------------ placing a batch

    def place(self, keys: list, lengths: list[int]) -> list[int]:
        """Slots for a batch of rows (`keys[i]` ends at `lengths[i]` tokens at most), consecutive when
        they can be made so; grows the store, within the budget, as needed. Keys without a slot get a
        free one and hold nothing yet."""
        for k in keys:
            self.used[k] = self.calls
        need_len = max(lengths)
        n = len(keys)
        start = self._block(keys, n)
        capacity = max(self.capacity, _round_up(need_len, self.grow_tokens))
        slots = max(self.slots, start + n)
        if slots * capacity * self.bytes_per_token > (self.budget or float("inf")):
            self._make_room(keys, n, capacity)
            start = self._block(keys, n)
            slots = max(self.slots, start + n)
            if slots * capacity * self.bytes_per_token > (self.budget or float("inf")):
                raise KVBudgetError(
                    f"the sampler's KV cache needs {_gb(slots * capacity * self.bytes_per_token)} GB for {n} sequences of "
                    f"up to {need_len} tokens, over sampling.kv_budget_gb={_gb(self.budget)} GB: lower sampling.batch_size "
                    f"(or rollout.tasks/group_size) or raise sampling.kv_budget_gb; a train run resumes from its last checkpoint")
        self._resize(slots, capacity)
        return self._fill(keys, start)

    def _block(self, keys: list, n: int) -> int:
        """The first slot of n consecutive slots holding as many of the batch's own slots as possible
        and no other live key's (the store grows past its end when none fits)."""
        mine = {self.slot_of[k] for k in keys if k in self.slot_of}
        best, best_start = -1, self.slots
        for start in range(0, self.slots + 1):
            block = range(start, start + n)
            if any(s < self.slots and self.owner[s] is not None and s not in mine for s in block):
                continue
            have = sum(s in mine for s in block)
            if have > best:
                best, best_start = have, start
            if have == len(mine):
                break
        return best_start

    def _fill(self, keys: list, start: int) -> list[int]:
        block = list(range(start, start + len(keys)))
        inside = {self.slot_of[k] for k in keys if k in self.slot_of and self.slot_of[k] in block}
        free = [s for s in block if s not in inside]
        out = []
        for k in keys:
            s = self.slot_of.get(k)
            if s is None or s not in block:
                target = free.pop(0)
                if s is not None:  # move its cache into the block
                    if self.ids.get(k):
                        self.copy_slot(s, target, len(self.ids[k]))
                        self.moves += 1
                    self.owner[s] = None
                s = target
                self.slot_of[k], self.owner[s] = s, k
            out.append(s)
        return out

    def _make_room(self, keys: list, n: int, capacity: int) -> None:
        """Over budget: drop the caches of keys this batch does not use (least recently used first)
        until it fits, then pack the survivors into the lowest slots and shrink the store."""
        if not self._warned:
            log.warning("the sampler's KV cache reached sampling.kv_budget_gb=%s GB: the caches of sequences not in "
                        "the current batch are dropped and re-run at their next turn (slower); raise the budget or "
                        "lower the number of rows", _gb(self.budget))
            self._warned = True
        batch = set(keys)
        others = sorted((k for k in self.slot_of if k not in batch), key=lambda k: self.used.get(k, 0))
        budget_rows = (self.budget or 0) // max(1, capacity * self.bytes_per_token)
        while others and len(self.slot_of) + sum(k not in self.slot_of for k in keys) > budget_rows:
            victim = others.pop(0)
            self.release([victim])
            self.dropped += 1
        # pack the live keys into slots 0..live-1, then shrink
        live = sorted(self.slot_of.items(), key=lambda kv: kv[1])
        for target, (k, s) in enumerate(live):
            if s != target:
                self.copy_slot(s, target, len(self.ids.get(k, ())))
                self.owner[s], self.owner[target] = None, k
                self.slot_of[k] = target
                self.moves += 1
        self._resize(len(live), self.capacity)

    # ------------------------------------------------------------ a forward

    def begin(self, slots: torch.Tensor, span: int | None, write_slot: torch.Tensor, write_pos: torch.Tensor,
              write_from: torch.Tensor | None, kv_len: int) -> None:
        """The next forward: its rows' slots ([b], `span` = the first slot when they are consecutive),
        where its new tokens go (flat (slot, position) pairs; `write_from`: their indices in the
        flattened [b * M] new tokens, None when every token is written in order), and how many
        positions attention reads."""
        self._fwd = (slots, span, write_slot, write_pos, write_from, kv_len)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        slots, span, write_slot, write_pos, write_from, kv_len = self._fwd
        b, h, m, d = key_states.shape
        kbuf, vbuf = self.k[layer_idx], self.v[layer_idx]
        if write_from is None and m == 1:
            kbuf[write_slot, :, write_pos] = key_states[:, :, 0]
            vbuf[write_slot, :, write_pos] = value_states[:, :, 0]
        else:
            new_k = key_states.transpose(1, 2).reshape(b * m, h, d)
            new_v = value_states.transpose(1, 2).reshape(b * m, h, d)
            if write_from is not None:
                new_k, new_v = new_k[write_from], new_v[write_from]
            kbuf[write_slot, :, write_pos] = new_k
            vbuf[write_slot, :, write_pos] = new_v
        if span is not None:
            return kbuf[span : span + b, :, :kv_len], vbuf[span : span + b, :, :kv_len]
        return kbuf[:, :, :kv_len].index_select(0, slots), vbuf[:, :, :kv_len].index_select(0, slots)

    def swap(self, a: int, b: int, n: int) -> None:
        """Exchange the first n positions of two slots and their owners (a decode batch keeps its
        running rows in consecutive slots by swapping them with rows that finished)."""
        for bufs in (self.k, self.v):
            for buf in bufs:
                tmp = buf[a, :, :n].clone()
                buf[a, :, :n] = buf[b, :, :n]
                buf[b, :, :n] = tmp
        ka, kb = self.owner[a], self.owner[b]
        self.owner[a], self.owner[b] = kb, ka
        if ka is not None:
            self.slot_of[ka] = b
        if kb is not None:
            self.slot_of[kb] = a
        self.moves += 1

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy a slot's first n positions (a shared prompt run once, a row moved to pack a batch)."""
        for bufs in (self.k, self.v):
            for buf in bufs:
                buf[dst, :, :n] = buf[src, :, :n]

    # the Cache interface transformers' model code may ask about
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._fwd is None else self._fwd[-1]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (0 if self._fwd is None else self._fwd[-1]), 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.n_layers

    def __repr__(self) -> str:
        return (f"SlotStore({self.live} live of {self.slots} slots x {self.capacity} tokens, "
                f"{_gb(self.nbytes)} GB, budget {_gb(self.budget) if self.budget else 'none'} GB)")


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _gb(n) -> str:
    return f"{n / (1 << 30):.2f}" if n is not None else "none"


# ---------------------------------------------------------------- the plan before a run


# an ALFWorld opening of typical length (a kitchen), for estimates made before any game is loaded
TYPICAL_FIRST_OBSERVATION = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 6, a cabinet 5, a cabinet 4, "
    "a cabinet 3, a cabinet 2, a cabinet 1, a coffeemachine 1, a countertop 3, a countertop 2, a countertop 1, "
    "a drawer 3, a drawer 2, a drawer 1, a fridge 1, a garbagecan 1, a microwave 1, a sinkbasin 1, a stoveburner 4, "
    "a stoveburner 3, a stoveburner 2, a stoveburner 1, and a toaster 1.\n\nYour task is to: put a clean mug in "
    "coffeemachine.")


def expected_context_tokens(cfg, max_steps: int, tokenizer) -> int:
    """Tokens one trajectory is expected to hold at its end: the rendered opening prompt (the run's
    prompt settings, a typical first observation) plus TOKENS_PER_STEP per step and one reply's room."""
    from agentrl.env import prompt_messages
    from agentrl.prompt import ChatRenderer

    messages = prompt_messages(cfg.env.kind, cfg.prompt)("pick_and_place_simple", TYPICAL_FIRST_OBSERVATION, cfg.prompt.dir)
    opening = len(ChatRenderer(tokenizer).initial(messages))
    return opening + TOKENS_PER_STEP * max_steps + cfg.sampling.max_new_tokens


def check_kv_fits(cfg, rows: int, max_steps: int, what: str) -> None:
    """Refuse, with one line and before anything is written, a run of `rows` trajectories stepped
    together whose expected KV cache exceeds the budget (hf sampler only: vLLM manages its own)."""
    if cfg.sampling.backend != "hf" or rows <= 0 or cfg.env.kind != "alfworld":
        return
    from transformers import AutoConfig

    from agentrl.models import load_tokenizer, pick_device, pick_dtype, resolve_model

    path = resolve_model(cfg.model.name)
    device = torch.device(pick_device(cfg.model.device))
    model_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    per_token = kv_bytes_per_token(model_config, pick_dtype(cfg.model.dtype, str(device)))
    tokens = expected_context_tokens(cfg, max_steps, load_tokenizer(cfg.model.name, cfg.model.trust_remote_code))
    need = rows * tokens * per_token
    budget = kv_budget_bytes(cfg.sampling.kv_budget_gb, device)
    if need > budget:
        raise UserError(f"{what}: {rows} {'trajectory' if rows == 1 else 'trajectories'} x ~{tokens} tokens need ~{_gb(need)} GB of KV cache, over "
                        f"sampling.kv_budget_gb={'auto: ' if cfg.sampling.kv_budget_gb == 'auto' else ''}{_gb(budget)} GB; "
                        + ("step fewer trajectories together (rollout.tasks x rollout.group_size"
                           + (", or more --rounds" if what == "rollout" else "") + "), " if rows > 1 else "")
                        + "lower env.max_steps, or raise sampling.kv_budget_gb")
