"""One decode batch, visible: its state (`DecodeState`), the step that samples and records one
token per running row (`decode_step`), and the compaction that leaves finished rows out
(`compact`). The hf sampler drives them (`HFSampler._decode`); issue 47's captured CUDA graph
replays the same step over static buffers.

- `decode_step` is device work only (no host sync, no Python branch on tensor values): the
  next token of every running row, its raw log-prob, and whether it stopped.
- The host looks at `done` only at sync points (every token on a CPU, every 8 on a GPU); there
  `compact` may leave finished rows out of the batch, swapping slots so the running rows stay
  consecutive (the store is then read as a view).
- Sampling is batched and reproducible per row: each row draws one uniform per token from a
  counter-based hash of (its seed, the token's index) and inverts its own CDF, so a row's
  tokens depend on its seed and its own logits only, never on its neighbours in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.sampling.base import SamplingParams
from agentrl.sampling.constraint import CommandSet, advance, batch_tables, constrain
from agentrl.sampling.kv import ForwardMeta, SlotStore


@dataclass
class DecodeState:
    """Every per-row structure of one decode batch. Rows are numbered in slot order: row r is the
    batch's request `order[r]`; `active` lists the rows still run through the model."""

    order: list[int]  # row -> index of the request in the batch
    row_slots: list[int]  # row -> its slot (compaction swaps them)
    prompt_len: list[int]  # row -> its prompt's length
    seeds: torch.Tensor  # [n] int64
    pos: torch.Tensor  # [n] position of each row's first new token
    tokens: torch.Tensor  # [n, T] generated ids
    logps: torch.Tensor  # [n, T] their raw log-probs
    length: torch.Tensor  # [n] tokens up to and including the stop token (T: none)
    done: torch.Tensor  # [n] bool: the row produced a stop token
    last: torch.Tensor  # [n] the last token of each row (the next forward's input)
    active: list[int]  # rows still run through the model, in slot order
    act: torch.Tensor  # `active` on the device
    act_slots: torch.Tensor  # their slots on the device
    span: int | None  # the first slot when the active rows' slots are consecutive
    longest: int  # the longest active prompt (host side: no sync per token)
    logits: torch.Tensor  # [len(active), V] each active row's next-token logits
    table: torch.Tensor | None = None  # [n, C, T] each row's commands' ids, -1 padded (constraint.py; None: free text)
    alive: torch.Tensor | None = None  # [n, C] the commands each row's reply still follows
    fed: list[int] | None = None  # row -> its reply tokens whose keys are stored (jump.py; None: all but the last)

    @classmethod
    def start(cls, logits: torch.Tensor, slots: list[int], prompt_len: list[int], seeds: list[int],
              max_new_tokens: int, constraints: list[CommandSet | None] | None = None) -> "DecodeState":
        """The state after the prefill: `logits` [n, V], `slots`, `prompt_len`, `seeds` and `constraints`
        (GenRequest.constraint) in request order."""
        n, device, T = len(slots), logits.device, max_new_tokens
        order = sorted(range(n), key=lambda i: slots[i])  # slot order: a batch in consecutive slots reads a view
        row_slots = [slots[i] for i in order]
        plen = [prompt_len[i] for i in order]
        tables = batch_tables([constraints[i] for i in order], T, device) if constraints else None
        return cls(
            order=order, row_slots=row_slots, prompt_len=plen,
            seeds=torch.tensor([int(seeds[i]) & ((1 << 63) - 1) for i in order], dtype=torch.long, device=device),
            pos=torch.tensor(plen, dtype=torch.long, device=device),
            tokens=torch.zeros((n, T), dtype=torch.long, device=device),
            logps=torch.zeros((n, T), dtype=torch.float32, device=device),
            length=torch.full((n,), T, dtype=torch.long, device=device),
            done=torch.zeros(n, dtype=torch.bool, device=device),
            last=torch.zeros(n, dtype=torch.long, device=device),
            active=list(range(n)), act=torch.arange(n, device=device),
            act_slots=torch.tensor(row_slots, device=device), span=span_of(row_slots), longest=max(plen),
            logits=logits[torch.tensor(order, device=device)],
            table=tables[0] if tables else None, alive=tables[1] if tables else None)

    def forward_meta(self, t: int) -> ForwardMeta:
        """The metadata of the forward that feeds token t of the active rows (written at pos + t)."""
        return ForwardMeta(slots=self.act_slots, span=self.span, write_slot=self.act_slots,
                           write_pos=self.pos[self.act] + t, write_from=None, kv_len=self.longest + t + 1)


def decode_step(state: DecodeState, t: int, params: SamplingParams, stop: torch.Tensor) -> None:
    """Token t of every active row from `state.logits`: chosen, recorded with its raw log-prob, and
    its stop checked. Device work only."""
    act, logits = state.act, state.logits
    if state.table is not None:  # admissible actions: the softmax renormalised over the alive commands' tokens
        column = state.table[act, :, t]
        logits = constrain(logits, column, state.alive[act])
    raw = torch.log_softmax(logits, dim=-1)
    chosen = choose(logits, params, state.seeds[act], t)
    if state.table is not None:
        state.alive[act] = advance(state.alive[act], column, chosen)
    state.tokens[act, t] = chosen
    state.logps[act, t] = raw.gather(1, chosen[:, None]).squeeze(1)
    newly = torch.isin(chosen, stop) & ~state.done[act]
    state.length[act] = torch.where(newly, t + 1, state.length[act])
    state.done[act] |= newly
    state.last[act] = chosen


def compact(state: DecodeState, alive: list[int], store: SlotStore, n: int) -> None:
    """Leave the finished rows out of the decode batch. When the batch sits in consecutive slots,
    running rows that sit past the first len(alive) slots swap places with finished rows before
    them (each row's first n positions), so the batch stays consecutive: one copy now instead
    of a gather at every token."""
    device = state.logits.device
    if state.span is None:
        state.active, state.span = alive, span_of([state.row_slots[r] for r in alive])
    else:
        row_slots, edge, kept = state.row_slots, state.span + len(alive), set(alive)
        misplaced = [r for r in alive if row_slots[r] >= edge]
        holes = [r for r in state.active if r not in kept and row_slots[r] < edge]
        for r, d in zip(misplaced, holes):
            store.swap(row_slots[r], row_slots[d], n)
            row_slots[r], row_slots[d] = row_slots[d], row_slots[r]
        state.active = sorted(alive, key=lambda r: row_slots[r])
    state.act = torch.tensor(state.active, device=device)
    state.act_slots = torch.tensor([state.row_slots[r] for r in state.active], device=device)
    state.longest = max(state.prompt_len[r] for r in state.active)


def span_of(slots: list[int]) -> int | None:
    """The first slot when `slots` are consecutive and ascending (the store is read as a view), else None."""
    if slots and all(b == a + 1 for a, b in zip(slots, slots[1:])):
        return slots[0]
    return None


# ---------------------------------------------------------------- sampling

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons): every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of (seed, token index t): 48 bits from two hashes
    (float64). The same on every device and whatever the batch. `t` may be a device scalar (the
    captured step's counter) or one index per row."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    index = torch.full_like(seeds, t) if isinstance(t, int) else t.expand_as(seeds)
    key = _mix32(lo ^ _mix32(hi ^ _mix32(index ^ 0x9E3779B9)))
    a = _mix32(key ^ 0x85EBCA6B) >> 8  # 24 bits
    b = _mix32(key ^ 0xC2B2AE35) >> 8  # 24 more
    return ((a * (1 << 24) + b).double() + 0.5) / float(1 << 48)


def choose(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, t: int) -> torch.Tensor:
    """The next token of every row: argmax (greedy), else inverse-CDF sampling of softmax(logits / T)
    (top-p: the smallest set of most likely tokens reaching top_p) with the row's own uniform."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(logits, seeds, t, params.temperature, params.top_p if params.top_p < 1.0 else None)


def sample(logits: torch.Tensor, seeds: torch.Tensor, t: int | torch.Tensor, temperature: float | torch.Tensor,
           top_p: float | torch.Tensor | None) -> torch.Tensor:
    """`choose`'s sampling, its values either Python numbers or device scalars (the captured step's
    static buffers: the same arithmetic, so the same tokens). `top_p` None: no nucleus cut."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = None
    if top_p is not None:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
    cdf = probs.cumsum(-1)
    u = row_uniforms(seeds, t) * cdf[:, -1]
    # the first token whose CDF reaches u: never one of zero probability (u > 0, flat steps are skipped)
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=cdf.shape[1] - 1).squeeze(1)
    return pick if order is None else order.gather(1, pick[:, None]).squeeze(1)
