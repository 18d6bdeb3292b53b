"""The decode step over static buffers: run eagerly on a CPU, captured as a CUDA graph on a GPU.

The eager token loop (decode.py) launches ~1,000 kernels per token from Python, and on a GPU the
host is what bounds it (issue 47: 74 ms per token step for ~2 ms of memory traffic). Here one
token step of a decode batch - sample from the current logits, record the token and its raw
log-prob, update the done flags, then the model's forward of the chosen tokens through the slot
store - reads and writes only tensors allocated once per graph key, so on CUDA it is captured
once into a `torch.cuda.CUDAGraph` and replayed with one launch per token.

- Graph key: (first slot of the batch, batch bucket, KV-read bucket, greedy, top-p on, T, command
  bucket: admissible actions' tables, constraint.py, 0 for free text). Every
  per-step scalar (token index, write positions, temperature, top_p) is a device tensor, the rest
  is in the key; every graph shares one memory pool.
- The batch reads the store as a view from its first slot (`SlotStore(hold_still=True)` keeps
  the live rows consecutive); rows past the live ones are padding: they write the store's
  scratch slot, sample garbage, and never change a real row (attention is per row).
- Attention reads `kv_read` positions of every row (a bucket of 256 past the longest context)
  with the per-row length mask built inside the step from the write positions.
- The host loads a segment's inputs, replays k steps back to back, then syncs once to read the
  done flags; rows that finished leave the batch (`decode.compact`) when that lets a smaller
  bucket serve the rest.
- Graphs are valid while the buffers they read hold still: the KV storage's `generation`
  (bumped by any reallocation) is checked before every replay, and a swap writes the merged
  weights in place (`copy_`, PEFT's in-place merge). An adapter served through PEFT's LoRA
  layers (unmerged) is run by the eager loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.sampling.base import SamplingParams
from agentrl.sampling.constraint import advance, column_at, constrain
from agentrl.sampling.decode import DecodeState, compact, sample
from agentrl.sampling.kv import ForwardMeta, SlotView, batch_bucket

KV_READ_STEP = 256  # positions: the KV-read buckets (attention reads up to 255 masked positions more per row)
COMMANDS_STEP = 32  # a constrained batch's command tables are padded to a multiple of this (fewer graph keys)


def kv_read_bucket(n: int, capacity: int) -> int:
    """Positions the step's attention reads for contexts up to n tokens (never past the store's capacity)."""
    return min(capacity, -(-n // KV_READ_STEP) * KV_READ_STEP)


@dataclass(frozen=True)
class StepKey:
    start: int  # the batch's first slot (the view's offset)
    rows: int  # batch bucket
    kv_read: int  # positions attention reads
    greedy: bool
    top_p: bool  # a nucleus cut (sorting the vocabulary) is part of the step
    max_new_tokens: int  # width of the token buffers
    commands: int = 0  # admissible actions: the command tables' bucket (0: free text, no constraint in the step)


class StaticStep:
    """The buffers of one graph key and the step that reads and writes only them (`run`)."""

    def __init__(self, key: StepKey, model, storage, cache_kwarg: str, stop: torch.Tensor, vocab: int, device):
        B, T = key.rows, key.max_new_tokens
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.key, self.model, self.storage, self.cache_kwarg, self.stop = key, model, storage, cache_kwarg, stop
        self.logits = z(B, vocab, dtype=torch.float32)  # each row's next-token logits
        self.seeds, self.write_slot, self.write_pos = z(B), z(B), z(B)  # write_pos: where token t's keys go
        self.t = z(1)  # the token index (a device counter)
        self.temperature = torch.ones((), dtype=torch.float64, device=device)
        self.top_p = torch.ones((), dtype=torch.float64, device=device)
        self.tokens, self.logps = z(B, T), z(B, T, dtype=torch.float32)
        self.length, self.done = z(B), z(B, dtype=torch.bool)
        self.positions = torch.arange(key.kv_read, device=device)[None, None, None, :]
        # constraint.py's tables: each row's commands' ids and which it still follows (padding rows: none)
        self.table = torch.full((B, key.commands, T), -1, dtype=torch.long, device=device) if key.commands else None
        self.alive = z(B, key.commands, dtype=torch.bool) if key.commands else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.generation = storage.generation

    def run(self) -> None:
        """One token step of the whole bucket: device work only, no host sync, no tensor built from host data."""
        key, logits = self.key, self.logits
        if key.commands:  # admissible actions (constraint.py): renormalised over the alive commands' next tokens
            column = column_at(self.table, self.t)
            logits = constrain(logits, column, self.alive)
        raw = torch.log_softmax(logits, dim=-1)
        if key.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            chosen = sample(logits, self.seeds, self.t, self.temperature, self.top_p if key.top_p else None)
        if key.commands:
            self.alive.copy_(advance(self.alive, column, chosen))
        column = self.t.expand(key.rows)[:, None]
        self.tokens.scatter_(1, column, chosen[:, None])
        self.logps.scatter_(1, column, raw.gather(1, chosen[:, None]))
        newly = torch.isin(chosen, self.stop) & ~self.done
        self.length.copy_(torch.where(newly, self.t + 1, self.length))
        self.done.logical_or_(newly)
        mask = self.positions <= self.write_pos[:, None, None, None]  # [B, 1, 1, kv_read]: each row's own length
        meta = ForwardMeta(slots=self.write_slot, span=key.start, write_slot=self.write_slot, write_pos=self.write_pos,
                           write_from=None, kv_len=key.kv_read)
        out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=self.write_pos[:, None],
                         use_cache=True, logits_to_keep=1, **{self.cache_kwarg: SlotView(self.storage, meta)})
        self.logits.copy_(out.logits[:, -1])
        self.write_pos.add_(1)
        self.t.add_(1)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()


class StaticDecoder:
    """The static steps of one sampler, by key; on CUDA each captured on first use into one shared pool."""

    def __init__(self, capture: bool):
        self.capture = capture  # False: the same steps run eagerly (a CPU; tests)
        self.steps: dict[StepKey, StaticStep] = {}
        self.pool = None
        self.captures = 0  # graphs captured (a reallocated store or a new key captures again)
        self.built = 0  # steps built, captured or not (on CUDA: = captures); what a reallocation costs
        self.replays = 0

    def step(self, key: StepKey, sampler, vocab: int) -> StaticStep:
        storage = sampler.store.storage
        if any(s.generation != storage.generation for s in self.steps.values()):
            self.forget()  # the store was reallocated: every graph reads old buffers (and holds pool memory)
        step = self.steps.get(key)
        if step is None:
            step = StaticStep(key, sampler.model, storage, sampler.cache_kwarg, sampler._stop_tensor, vocab,
                              sampler.device)
            if self.capture:
                self._capture(step, sampler.store.scratch)
            self.steps[key] = step
            self.built += 1
        return step

    def forget(self) -> None:
        """Drop every graph (the store was reallocated, the model's weights moved: an unmerged
        adapter, a new model), and their pool with them: torch's allocator refuses a capture into a
        pool whose graphs are all gone before its memory was freed (an internal assert at
        capture_begin, seen on an H100 with torch 2.11), so the next capture starts a new pool."""
        self.steps.clear()
        self.pool = None

    def _capture(self, step: StaticStep, scratch: int) -> None:
        """Warm up on a side stream (as torch's docs require), then capture. Every row writes the
        scratch slot meanwhile, so neither touches a live row's cache."""
        step.write_slot.fill_(scratch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step.t.zero_()  # token 0 and position 0: inside every buffer whatever max_new_tokens is
                step.write_pos.zero_()
                step.run()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # one pool for every graph: safe in any replay order, as nothing a graph allocates is read
        # after its replay (the step's inputs and outputs are buffers allocated outside the capture);
        # thread_local: env threads of the rollout never touch CUDA, but must not break a capture either
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step.run()
        step.graph = graph
        self.captures += 1


def decode_static(sampler, state: DecodeState, params: SamplingParams, every: int) -> None:
    """The token loop of `HFSampler._decode` on static steps: the same tokens and log-probs as the
    eager loop (decode.py), k = `every` steps between host syncs. Needs the batch in consecutive
    slots (`state.span`), as a store that holds still places it."""
    T, store = params.max_new_tokens, sampler.store
    t = 0
    while t < T:
        key = StepKey(start=state.span, rows=batch_bucket(len(state.active)),
                      kv_read=kv_read_bucket(state.longest + T, store.capacity), greedy=params.greedy,
                      top_p=not params.greedy and params.top_p < 1.0, max_new_tokens=T,
                      commands=0 if state.table is None else -(-state.table.shape[1] // COMMANDS_STEP) * COMMANDS_STEP)
        step = sampler.static.step(key, sampler, state.logits.shape[-1])
        _load(step, state, params, t, store.scratch)
        while True:
            step.replay()  # the last token's forward is wasted: it keeps one graph per key
            sampler.static.replays += 1
            t += 1
            if t == T or t % every == 0:
                break
        _unload(step, state)
        if t == T:
            break
        finished = state.done.tolist()  # the only host sync of a segment
        alive = [r for r in state.active if not finished[r]]
        if not alive:
            break
        before = {r: i for i, r in enumerate(state.active)}  # row -> its place in the step's buffers
        if batch_bucket(len(alive)) < key.rows:  # a smaller graph serves the rest
            compact(state, alive, store, state.longest + t)
        # the next token's logits, already computed by the last replay, in the (new) active order
        state.logits = step.logits[torch.tensor([before[r] for r in state.active], device=step.logits.device)]


def _load(step: StaticStep, state: DecodeState, params: SamplingParams, t: int, scratch: int) -> None:
    """A segment's inputs into the step's buffers; rows past the live ones are padding (scratch slot)."""
    n, act = len(state.active), state.act
    step.logits[:n] = state.logits
    step.seeds[:n] = state.seeds[act]
    step.write_slot.fill_(scratch)
    step.write_slot[:n] = state.act_slots
    step.write_pos.zero_()
    step.write_pos[:n] = state.pos[act] + t
    step.t.fill_(t)
    step.tokens[:n], step.logps[:n] = state.tokens[act], state.logps[act]
    step.length[:n], step.done[:n] = state.length[act], state.done[act]
    step.done[n:] = True  # padding rows never count as newly stopped
    step.temperature.fill_(max(params.temperature, 1e-6))
    step.top_p.fill_(params.top_p)
    if step.table is not None:
        C = state.table.shape[1]
        step.table.fill_(-1)
        step.alive.zero_()
        step.table[:n, :C], step.alive[:n, :C] = state.table[act], state.alive[act]


def _unload(step: StaticStep, state: DecodeState) -> None:
    n, act = len(state.active), state.act
    state.tokens[act], state.logps[act] = step.tokens[:n], step.logps[:n]
    state.length[act], state.done[act] = step.length[:n], step.done[:n]
    if step.table is not None:
        state.alive[act] = step.alive[:n, : state.alive.shape[1]]
