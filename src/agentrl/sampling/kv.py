"""The slot KV engine: an allocator (which key owns which slot), a storage (the tensors), and the
attention over per-row lengths.

`KVStorage`: per layer one key and one value buffer of shape [slots, kv_heads, capacity,
head_dim]. It is resized only by the allocator's `place` and `release`, between batches, and is
pinned while a batch runs (a resize then raises): a running batch, and issue 47's captured decode
step, always sees the same buffers. Growing is done one layer at a time, so it never holds two
copies of the store.

`SlotStore`: the allocator, plain bookkeeping. Each live sequence (a sampler `key`: one
trajectory) owns a slot and the ids its slot holds; its next turn writes only the new tokens,
right after its cached prefix; a released sequence frees its slot for the next one. Nothing is
cloned per row, re-stacked or batch-selected: a batch whose rows sit in consecutive slots reads
the buffer as a view, others gather only the rows they need.

A forward gets its metadata explicitly: a `ForwardMeta` (rows' slots, where the new tokens are
written, how many positions attention reads) wrapped with the storage in a `SlotView`, the
`transformers.Cache` handed to that one forward (each attention layer calls its `update`). The
attention is a function registered through transformers' `AttentionInterface` ("agentrl_slots"):
SDPA over the slot rows with a mask of per-row lengths built on the device, query heads grouped
per KV head, so K and V are never copied out to every query head (SmolLM2: 3 KV heads serve 9).

A store that holds still (`hold_still`, the captured decode step's: a CUDA graph records buffer
addresses) never shrinks when sequences end, grows its capacity in larger steps, keeps its last
slot as a scratch row that padding rows of a static batch write into, and leaves room after every
batch for it to be padded to its bucket (`batch_bucket`). Every reallocation bumps
`KVStorage.generation`, so graphs captured on the old buffers are dropped, never replayed.

Memory is bounded by a budget (`sampling.kv_budget_gb`, auto: from free memory): past it the
store first drops the caches of sequences the current batch does not need (they are re-run
from their tokens at their next turn: slower, never wrong), and only when one batch alone
cannot fit does it stop the run with one line naming the knobs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from agentrl.errors import RunError
from agentrl.sampling import cpu_attention
from agentrl.sampling.budget import gb
from agentrl.sampling.compat import kv_bytes_per_token, kv_shape, text_config

log = logging.getLogger(__name__)

ATTENTION = "agentrl_slots"


class KVBudgetError(RunError):
    """One batch of the sampler cannot fit the KV budget: the run stops cleanly (checkpoint intact)."""


# ---------------------------------------------------------------- attention


# whether a decode step's and a prefill's attention run agentrl's CPU kernel (cpu_attention.py), set
# around the sampler's calls by `use_slot_attention` (attention.cpu_kernel_for decides)
_decode_kernel: ContextVar[bool] = ContextVar("agentrl_decode_kernel", default=False)
_prefill_kernel: ContextVar[bool] = ContextVar("agentrl_prefill_kernel", default=False)


def slot_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of `query` [b, Hq, M, D] over the slot rows `key`/`value` [b, Hkv, L, D] with the
    store's boolean mask [b, 1, M, L]. Query heads are grouped per KV head (a decode step: the g
    query heads of a KV head become g query rows of it; a prefill: SDPA's enable_gqa), so no
    copy of K or V is made for each query head. A decode step and a prefill run agentrl's CPU
    kernels where the sampler chose them, else SDPA."""
    b, hq, m, d = query.shape
    hkv = key.shape[1]
    if m == 1:
        g = hq // hkv
        q = query.reshape(b, hkv, g, d)
        mask = attention_mask.reshape(b, 1, 1, -1)
        out = None
        if _decode_kernel.get():
            scale = scaling if scaling is not None else d ** -0.5
            out = cpu_attention.decode(q, key, value, mask, scale)
        if out is None:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
        return out.reshape(b, 1, hq, d), None
    if _prefill_kernel.get():
        out = cpu_attention.prefill(query, key, value, attention_mask, scaling if scaling is not None else d ** -0.5)
        if out is not None:
            return out, None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=hq != hkv)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, slot_attention)


class use_slot_attention:
    """Route the model's attention through `slot_attention` for the duration of a sampler call
    (restored after, so a learner sharing the model keeps its own attention); `decode_kernel`,
    `prefill_kernel`: decode steps, prefills run agentrl's CPU kernel in it."""

    def __init__(self, model, decode_kernel: bool = False, prefill_kernel: bool = False):
        self.config = text_config(model.config)
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel

    def __enter__(self):
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION
        self.tokens = _decode_kernel.set(self.decode_kernel), _prefill_kernel.set(self.prefill_kernel)

    def __exit__(self, *exc):
        self.config._attn_implementation = self.previous
        _decode_kernel.reset(self.tokens[0])
        _prefill_kernel.reset(self.tokens[1])


# ---------------------------------------------------------------- the storage


@dataclass(frozen=True)
class ForwardMeta:
    """What one forward writes and reads: its rows' slots [b] (`span`: the first slot when they are
    consecutive, so the buffer is read as a view), where its new tokens go (flat (slot, position)
    pairs; `write_from`: their indices in the flattened [b * M] new tokens, None when every token
    is written in order), and how many positions attention reads."""

    slots: torch.Tensor
    span: int | None
    write_slot: torch.Tensor
    write_pos: torch.Tensor
    write_from: torch.Tensor | None
    kv_len: int


def left_padded(rows: list[tuple[int, list[int], int]], shape: tuple[int, int], pad_id: int, read, span: int | None,
                kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor, ForwardMeta]:
    """A forward of several rows' new tokens, each row `(slot, tokens, position of its first)`
    left-padded to M of `shape` [B, M] (rows past len(rows): all pads). Pads come first, at position
    0, and are never written (the mask then hides them from every real token). Returns the ids and
    positions [B, M] on `device` and the forward's metadata (reading the slots `read`)."""
    B, M = shape
    ids = torch.full((B, M), pad_id, dtype=torch.long)
    qpos = torch.zeros((B, M), dtype=torch.long)
    w_slot, w_pos, w_from = [], [], []
    for j, (slot, tokens, start) in enumerate(rows):
        m = len(tokens)
        ids[j, M - m:] = torch.tensor(tokens, dtype=torch.long)
        qpos[j, M - m:] = torch.arange(start, start + m)
        w_slot += [slot] * m
        w_pos += range(start, start + m)
        w_from += range(j * M + M - m, j * M + M)
    t = lambda x: torch.as_tensor(x, dtype=torch.long, device=device)  # noqa: E731
    meta = ForwardMeta(slots=t(read), span=span, write_slot=t(w_slot), write_pos=t(w_pos),
                       write_from=None if B * M == len(w_from) else t(w_from), kv_len=kv_len)
    return ids.to(device), qpos.to(device), meta


class KVStorage:
    """The key and value tensors, [slots, kv_heads, capacity, head_dim] per layer (module docstring)."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.kv_heads, self.head_dim = kv_shape(config)
        self.dtype, self.device = dtype, torch.device(device)
        self.bytes_per_token = kv_bytes_per_token(config, dtype)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0  # rows of every buffer
        self.capacity = 0  # token positions of every row
        self.peak_bytes = 0
        self.peak_shape = (0, 0)  # (slots, capacity) when the store was largest
        self.pinned = False  # a batch is running: the buffers must not change
        self.generation = 0  # bumped whenever the buffers are reallocated (captured graphs hold their addresses)

    @property
    def nbytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token

    @contextmanager
    def pin(self):
        """The buffers stay as they are while a batch runs (a resize raises)."""
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False

    def resize(self, slots: int, capacity: int) -> None:
        """New buffers of [slots, H, capacity, D], layer by layer (the old layer is freed before the next
        is made, so the peak is the store plus one layer). Rows and positions beyond the new size are dropped."""
        if slots == self.slots and capacity == self.capacity:
            return
        if self.pinned:
            raise RuntimeError("the KV storage cannot be resized under a running batch")
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
        self.slots, self.capacity = slots, capacity
        self.generation += 1
        if self.nbytes > self.peak_bytes:
            self.peak_bytes, self.peak_shape = self.nbytes, (slots, capacity)

    def write_read(self, meta: ForwardMeta, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one layer's new keys and values where `meta` says, return the rows' first kv_len positions."""
        b, h, m, d = key_states.shape
        kbuf, vbuf = self.k[layer], self.v[layer]
        if meta.write_from is None and m == 1:
            kbuf[meta.write_slot, :, meta.write_pos] = key_states[:, :, 0]
            vbuf[meta.write_slot, :, meta.write_pos] = value_states[:, :, 0]
        else:
            new_k = key_states.transpose(1, 2).reshape(b * m, h, d)
            new_v = value_states.transpose(1, 2).reshape(b * m, h, d)
            if meta.write_from is not None:
                new_k, new_v = new_k[meta.write_from], new_v[meta.write_from]
            kbuf[meta.write_slot, :, meta.write_pos] = new_k
            vbuf[meta.write_slot, :, meta.write_pos] = new_v
        n = meta.kv_len
        if meta.span is not None:
            return kbuf[meta.span : meta.span + b, :, :n], vbuf[meta.span : meta.span + b, :, :n]
        return kbuf[:, :, :n].index_select(0, meta.slots), vbuf[:, :, :n].index_select(0, meta.slots)

    def swap(self, a: int, b: int, n: int) -> None:
        """Exchange the first n positions of two slots."""
        for bufs in (self.k, self.v):
            for buf in bufs:
                tmp = buf[a, :, :n].clone()
                buf[a, :, :n] = buf[b, :, :n]
                buf[b, :, :n] = tmp

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy a slot's first n positions (a shared prompt run once, a row moved to pack a batch)."""
        for bufs in (self.k, self.v):
            for buf in bufs:
                buf[dst, :, :n] = buf[src, :, :n]


class SlotView(Cache):
    """The `transformers.Cache` of one forward: the storage and that forward's `ForwardMeta`."""

    def __init__(self, storage: KVStorage, meta: ForwardMeta):
        super().__init__(layers=[])
        self.storage, self.meta = storage, meta

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.storage.write_read(self.meta, layer_idx, key_states, value_states)

    # the Cache interface transformers' model code may ask about
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.meta.kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.meta.kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.storage.n_layers


# ---------------------------------------------------------------- the allocator


class SlotStore:
    """Which key owns which slot and what it holds (see the module docstring); the tensors are its
    `storage`. The sampler drives it: `reusable` (how much of a prompt a key has cached), `place`
    (slots for a batch, packed into consecutive slots when possible, storage sized, the budget
    kept), `hold` (what a key now holds), `swap` (compaction), `release`."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, budget_bytes: int | None = None,
                 grow_tokens: int = 128, hold_still: bool = False):
        self.storage = KVStorage(config, dtype, device)
        self.bytes_per_token = self.storage.bytes_per_token
        self.budget = budget_bytes
        self.hold_still = hold_still  # see the module docstring: the captured decode step's store
        self.grow_tokens = max(grow_tokens, 512) if hold_still else grow_tokens
        self.owner: list = []  # slot -> key, None when free
        self.slot_of: dict = {}  # key -> slot
        self.ids: dict = {}  # key -> the token ids whose keys and values its slot holds
        self.used: dict = {}  # key -> the call that last used it (drop order under memory pressure)
        self.calls = 0
        self.moves = 0  # rows moved to pack a batch into consecutive slots
        self.dropped = 0  # caches dropped under the budget (re-run at their next turn)
        self._warned = False

    # ------------------------------------------------------------ size

    @property
    def slots(self) -> int:
        return self.storage.slots

    @property
    def capacity(self) -> int:
        return self.storage.capacity

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def peak_bytes(self) -> int:
        return self.storage.peak_bytes

    @property
    def live(self) -> int:
        return len(self.slot_of)

    @property
    def scratch(self) -> int | None:
        """The slot padding rows of a static batch write into (a store that holds still: its last)."""
        return self.slots - 1 if self.hold_still and self.slots else None

    def _resize(self, slots: int, capacity: int) -> None:
        if self.scratch is not None:
            self.owner[self.scratch] = None
        self.storage.resize(slots, capacity)
        self.owner = (self.owner + [None] * slots)[:slots]
        if self.scratch is not None:
            self.owner[self.scratch] = _SCRATCH

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
        if not self.slot_of and not self.hold_still:  # nothing live: give the memory back (the learner may want it)
            self._resize(0, 0)

    def stale(self) -> list:
        """Keys that missed the last two calls (for callers that never release; the rollout's two
        waves take turns, so a key missing one call is still live)."""
        return [k for k, c in self.used.items() if self.calls - c >= 3]

    def reserve(self, rows: int, tokens: int) -> None:
        """Take, now, the size a batch of `rows` rows of up to `tokens` tokens each needs (a store
        that holds still: the bucket's padding rows and the scratch slot included), so the store is
        not reallocated as those rows grow: under a captured decode step every reallocation drops
        the graphs, and on a CPU each one costs a fresh allocation and a copy of the whole store
        (~1.6 GB/s on the 2-core machine: 46 of a 12-step 140-game eval's 449 s of generation
        went to 11 of them, docs/measurements/sampler.md). The plan is what the run was checked
        to fit before it started (`rollout.plan.check_kv_fits`). Within the budget only (past it
        the store grows as before); never smaller than it is."""
        if rows <= 0 or tokens <= 0:
            return
        slots = max(self.slots, batch_bucket(rows) + 1 if self.hold_still else rows)
        capacity = max(self.capacity, round_up(tokens, self.grow_tokens))
        if slots * capacity * self.bytes_per_token <= (self.budget or float("inf")):
            self._resize(slots, capacity)

    # ------------------------------------------------------------ placing a batch

    def place(self, keys: list, lengths: list[int]) -> list[int]:
        """Slots for a batch of rows (`keys[i]` ends at `lengths[i]` tokens at most), consecutive when
        they can be made so; sizes the storage, within the budget, for the whole batch up front (a
        batch that cannot fit is refused here, before it runs). Keys without a slot get a free one
        and hold nothing yet."""
        for k in keys:
            self.used[k] = self.calls
        need_len = max(lengths)
        n = len(keys)
        start = self._block(keys, n)
        capacity = max(self.capacity, round_up(need_len, self.grow_tokens))
        slots = self._slots_for(start, n)
        if slots * capacity * self.bytes_per_token > (self.budget or float("inf")):
            self._make_room(keys, n, capacity)
            start = self._block(keys, n)
            slots = self._slots_for(start, n)
            if slots * capacity * self.bytes_per_token > (self.budget or float("inf")):
                raise KVBudgetError(
                    f"the sampler's KV cache needs {gb(slots * capacity * self.bytes_per_token)} GB for {n} sequences of "
                    f"up to {need_len} tokens, over sampling.kv_budget_gb={gb(self.budget)} GB: lower sampling.batch_size "
                    f"(or rollout.tasks/group_size) or raise sampling.kv_budget_gb; a train run resumes from its last checkpoint")
        self._resize(slots, capacity)
        return self._fill(keys, start)

    def _slots_for(self, start: int, n: int) -> int:
        """Slots the storage needs for n rows from `start`: a store that holds still also fits the
        batch padded to its bucket, and a scratch slot after it."""
        if not self.hold_still:
            return max(self.slots, start + n)
        need = start + batch_bucket(n)
        return self.slots if self.slots >= need and self.slots - 1 >= start + n else need + 1

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
                        self.storage.copy_slot(s, target, len(self.ids[k]))
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
                        "lower the number of rows", gb(self.budget))
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
                self.storage.copy_slot(s, target, len(self.ids.get(k, ())))
                self.owner[s], self.owner[target] = None, k
                self.slot_of[k] = target
                self.moves += 1
        self._resize(len(live) + (1 if self.hold_still else 0), self.capacity)

    # ------------------------------------------------------------ rows of a running batch

    def swap(self, a: int, b: int, n: int) -> None:
        """Exchange the first n positions of two slots and their owners (a decode batch keeps its
        running rows in consecutive slots by swapping them with rows that finished)."""
        self.storage.swap(a, b, n)
        ka, kb = self.owner[a], self.owner[b]
        self.owner[a], self.owner[b] = kb, ka
        if ka is not None:
            self.slot_of[ka] = b
        if kb is not None:
            self.slot_of[kb] = a
        self.moves += 1

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        self.storage.copy_slot(src, dst, n)

    def __repr__(self) -> str:
        return (f"SlotStore({self.live} live of {self.slots} slots x {self.capacity} tokens, "
                f"{gb(self.nbytes)} GB, budget {gb(self.budget) if self.budget else 'none'} GB)")


class _Scratch:
    """The owner of a store's scratch slot (never a key)."""

    def __repr__(self) -> str:
        return "<scratch>"


_SCRATCH = _Scratch()


def batch_bucket(n: int) -> int:
    """The rows of a static decode batch of n live rows (the CUDA graph sizes): a power of two up to
    8, then multiples of 8 up to 64, then of 32. Padding rows cost compute, never results."""
    if n <= 8:
        return 1 << max(0, n - 1).bit_length()
    step = 8 if n <= 64 else 32
    return round_up(n, step)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step
