"""transformers sampler: the slot KV engine, a device-side token loop, per-row seeds.

We decode with our own loop rather than `model.generate` because the contract needs per-row
seeds (trajectory i of a task samples the same tokens whatever else is in the batch), the raw
log-prob of every generated token, and KV reuse across the turns of a trajectory.

- Memory: every live trajectory owns a slot of one KV store (`kv.SlotStore`): a turn writes
  its new tokens after the cached prefix, a finished trajectory's slot is reused at once.
- Attention: transformers' own model code with a registered attention function over the slot
  rows (per-row lengths, query heads grouped per KV head).
- The token loop keeps everything on the device: log-probs gathered there, stop tokens found
  with `isin`, finished rows stay in the batch (masked) until a sync point (every token on a
  CPU, where a sync is free; every 8 on a GPU), where they leave it by swapping slots with
  running rows, so the batch stays in consecutive slots; results come to the host in one transfer.
- Sampling is batched and reproducible per row: each row draws one uniform per token from a
  counter-based hash of (its seed, the token's index) and inverts its own CDF, so a row's
  tokens depend on its seed and its own logits only, never on its neighbours in the batch.
- The adapter is merged into the sampler's weights (PEFT's merge): an unmerged LoRA on the seven
  projections nearly doubles the ops a forward dispatches (the default model with an r 32
  adapter: 13.2k vs 7.1k aten calls, nested ones included), and dispatch is what bounds the
  loop on a GPU. A hot-swap copies the saved base weights back before the next merge, so swaps
  never accumulate rounding.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from agentrl.errors import UserError
from agentrl.sampling.base import Completion, SamplingParams
from agentrl.sampling.kv import SlotStore, kv_budget_bytes, servable_length, use_slot_attention

log = logging.getLogger(__name__)


def stop_token_ids(tokenizer, model=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        ids.add(tid)
    return {i for i in ids if i is not None}


def cache_kwarg(model) -> str:
    """The forward's name for the KV cache: `cache` since transformers 5.x renamed it (the old name
    warns at every call), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class HFSampler:
    def __init__(self, model, tokenizer, batch_size: int = 64, adapter: str | None = None,
                 kv_budget_gb: float | str | None = "auto", sync_every: int | None = None, merge_adapter: bool = True):
        self.max_model_len: int | None = servable_length(model.config)  # refuses a model it cannot serve exactly
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.sync_every = sync_every  # tokens between host syncs (None: every token on a CPU, 8 on a GPU)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.adapter_version: int | None = None
        self.cache_kwarg = cache_kwarg(model)  # read once: the forward's signature does not change with an adapter
        self.merge_adapter = merge_adapter  # serve the adapter merged into the weights (False: PEFT's LoRA layers)
        self._base_weights: dict[str, torch.Tensor] = {}  # each LoRA layer's base weight before any merge (host memory)
        param = next(model.parameters())
        self.store = SlotStore(model.config, param.dtype, param.device, kv_budget_bytes(kv_budget_gb, param.device))
        self.prefill_tokens = 0  # prompt tokens run through the model (not counting reused ones)
        self.reused_tokens = 0  # prompt tokens served from a kept KV cache
        self.prefill_pad_tokens = 0  # pads run beside them to batch rows of unequal length
        self._anonymous = 0
        if adapter:
            self.load_adapter(adapter, version=0)

    def sleep(self) -> None:
        """Nothing to give back: the model shares its device with the learner as it is."""

    @classmethod
    def from_config(cls, cfg, model=None, tokenizer=None, colocated: bool = False) -> "HFSampler":
        if model is None or tokenizer is None:
            from agentrl.models import load_model

            model, tokenizer = load_model(cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)
        return cls(model, tokenizer, batch_size=cfg.sampling.batch_size, adapter=cfg.model.adapter,
                   kv_budget_gb=cfg.sampling.kv_budget_gb, merge_adapter=cfg.sampling.merge_adapter)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _stop_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(self.stop_ids), device=self.device)

    def load_adapter(self, path: str, version: int | None = None) -> None:
        from peft import PeftModel

        from agentrl.models import quiet_peft

        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise UserError(f"adapter directory {p} has no adapter_config.json (not a PEFT adapter)")
        name = f"v{version if version is not None else 0}"
        self._unmerge()
        try:
            if isinstance(self.model, PeftModel):
                previous = self.model.active_adapter
                if name in self.model.peft_config:  # reloading a version name: replace it
                    self.model.delete_adapter(name)
                self.model.load_adapter(str(p), adapter_name=name, is_trainable=False)
                self.model.set_adapter(name)
                if previous != name and previous in self.model.peft_config:
                    self.model.delete_adapter(previous)  # hot-swap: only one adapter stays resident
            else:
                with quiet_peft():
                    self.model = PeftModel.from_pretrained(self.model, str(p), adapter_name=name, is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as e:
            self._merge()  # the previous adapter stays, as it was served
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UserError(f"adapter {p} does not fit the base model: {first}") from None
        self._merge()
        self.model.eval()
        self.adapter_version = version
        self.store.release(list(self.store.slot_of))  # caches computed with the old weights are stale

    def _lora_layers(self) -> list:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        if not isinstance(self.model, PeftModel):
            return []
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, BaseTunerLayer)]

    def _merge(self) -> None:
        """Merge the active adapter into the base weights (saving each layer's base weight first).
        An adapter PEFT cannot merge is served through its LoRA layers, as before."""
        layers = self._lora_layers()
        if not self.merge_adapter or not layers or any(m.merged for _, m in layers):
            return
        for n, m in layers:
            if n not in self._base_weights:
                # kept in host memory: on a GPU the copy would take room the KV budget counted on
                self._base_weights[n] = m.get_base_layer().weight.detach().to("cpu", copy=True)
        try:
            self.model.merge_adapter()
        except (ValueError, RuntimeError, NotImplementedError) as e:
            self._restore(layers)
            log.warning("serving the adapter unmerged (PEFT cannot merge it: %s)", str(e).strip().splitlines()[0])

    def _unmerge(self) -> None:
        """Back to the base weights, exactly: PEFT's unmerge subtracts the delta again (in bf16 that
        rounds, and swaps would accumulate it), so the saved weights are copied back over."""
        layers = self._lora_layers()
        if any(m.merged for _, m in layers):
            self._restore(layers)

    def _restore(self, layers) -> None:
        with torch.no_grad():
            for n, m in layers:
                if m.merged:
                    m.unmerge()  # PEFT's bookkeeping (its merged_adapters); the weight is then set exactly
                if n in self._base_weights:
                    m.get_base_layer().weight.copy_(self._base_weights[n])

    def release(self, keys) -> None:
        """The sequences named by `keys` are over: their slots are free for the next ones."""
        self.store.release(list(keys))

    def rows_that_fit(self, tokens_per_row: int) -> int:
        """How many sequences of `tokens_per_row` tokens the KV budget holds at once."""
        return int(self.store.budget // max(1, tokens_per_row * self.store.bytes_per_token)) if self.store.budget else 1 << 30

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, keys: list | None = None
    ) -> list[Completion]:
        """`keys[i]` names the sequence prompt i continues (e.g. a trajectory): its cached tokens are
        reused when they are a prefix of the prompt, so a multi-turn step runs only the new
        observation. A key lives until `release`d, or until it misses two calls in a row (callers
        that never release; the rollout's two waves take turns)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError("one key per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        names = self._names(keys, len(prompts))
        self.store.calls += 1
        self.store.release([k for k in self.store.stale() if k not in set(names)])
        out: list[Completion] = []
        try:
            with use_slot_attention(self.model):
                for start in range(0, len(prompts), self.batch_size):
                    end = start + self.batch_size
                    out.extend(self._generate_batch(prompts[start:end], params, seeds[start:end], names[start:end]))
        finally:
            self.store.release([n for n in names if isinstance(n, _Anonymous)])
        return out

    def _names(self, keys, n: int) -> list:
        """Each row's key in the store; rows without one (or a repeated one) get a key of their own for this call."""
        names, seen = [], set()
        for i in range(n):
            k = None if keys is None else keys[i]
            if k is None or k in seen:
                self._anonymous += 1
                k = _Anonymous(self._anonymous)
            seen.add(k)
            names.append(k)
        return names

    # ------------------------------------------------------------------ one batch

    def _generate_batch(self, prompts, params: SamplingParams, seeds, names) -> list[Completion]:
        n, device, store = len(prompts), self.device, self.store
        cached = [store.reusable(k, p) for k, p in zip(names, prompts)]
        self.reused_tokens += sum(cached)
        slots = store.place(names, [len(p) + params.max_new_tokens for p in prompts])
        for k, c, p in zip(names, cached, prompts):
            store.hold(k, p[:c])
        logits = self._prefill(prompts, cached, slots)
        for k, p in zip(names, prompts):
            store.hold(k, list(p))

        # decode: rows in slot order, so a batch in consecutive slots reads the store as a view
        order = sorted(range(n), key=lambda i: slots[i])
        row_slots = [slots[i] for i in order]
        prompt_len = [len(prompts[i]) for i in order]
        logits = logits[torch.tensor(order, device=device)]
        seed_t = torch.tensor([int(seeds[i]) & ((1 << 63) - 1) for i in order], dtype=torch.long, device=device)
        pos = torch.tensor(prompt_len, dtype=torch.long, device=device)  # position of each row's first new token
        T = params.max_new_tokens
        tokens = torch.zeros((n, T), dtype=torch.long, device=device)
        logps = torch.zeros((n, T), dtype=torch.float32, device=device)
        length = torch.full((n,), T, dtype=torch.long, device=device)  # tokens up to and including the stop token
        done = torch.zeros(n, dtype=torch.bool, device=device)
        last = torch.zeros(n, dtype=torch.long, device=device)
        stop = self._stop_tensor
        active = list(range(n))  # rows still run through the model, in slot order
        act = torch.arange(n, device=device)
        act_slots = torch.tensor(row_slots, device=device)
        span = _span(row_slots)
        longest = max(prompt_len)  # the longest active prompt (host side: no sync per token)
        every = self.sync_every or (1 if device.type == "cpu" else 8)  # a host sync is free on a CPU
        for t in range(T):
            raw = torch.log_softmax(logits, dim=-1)
            chosen = _choose(logits, params, seed_t[act], t)
            tokens[act, t] = chosen
            logps[act, t] = raw.gather(1, chosen[:, None]).squeeze(1)
            newly = torch.isin(chosen, stop) & ~done[act]
            length[act] = torch.where(newly, t + 1, length[act])
            done[act] |= newly
            last[act] = chosen
            if t == T - 1:
                break
            if (t + 1) % every == 0:  # the only host syncs of the loop
                finished = done.tolist()
                alive = [r for r in active if not finished[r]]
                if not alive:
                    break
                if len(alive) < len(active) and (device.type == "cpu" or len(alive) <= len(active) // 2):
                    active, span = self._compact(active, alive, row_slots, span, longest + t)
                    act = torch.tensor(active, device=device)
                    act_slots = torch.tensor([row_slots[r] for r in active], device=device)
                    longest = max(prompt_len[r] for r in active)
            logits = self._forward(last[act][:, None], (pos[act] + t)[:, None], act_slots, span, write_from=None,
                                   kv_len=longest + t + 1)
        tokens, logps, length = tokens.cpu(), logps.cpu(), length.cpu()  # one transfer per batch

        out: list[Completion | None] = [None] * n
        for r, i in enumerate(order):
            m = int(length[r])
            ids = tokens[r, :m].tolist()
            reason = "stop" if ids[-1] in self.stop_ids else "length"
            store.hold(names[i], list(prompts[i]) + ids[:-1])  # the last token's keys are not computed yet
            out[i] = Completion(prompt_ids=list(prompts[i]), token_ids=ids, logprobs=logps[r, :m].tolist(),
                                text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=reason,
                                adapter_version=self.adapter_version)
        return out

    def _compact(self, active: list[int], alive: list[int], row_slots: list[int], span: int | None, n: int):
        """Leave the finished rows out of the decode batch. When the batch sits in consecutive slots,
        running rows that sit past the first len(alive) slots swap places with finished rows before
        them (each row's first n positions), so the batch stays consecutive: one copy now instead
        of a gather at every token."""
        if span is None:
            return alive, _span([row_slots[r] for r in alive])
        edge = span + len(alive)
        misplaced = [r for r in alive if row_slots[r] >= edge]
        holes = [r for r in active if r not in set(alive) and row_slots[r] < edge]
        for r, d in zip(misplaced, holes):
            self.store.swap(row_slots[r], row_slots[d], n)
            row_slots[r], row_slots[d] = row_slots[d], row_slots[r]
        return sorted(alive, key=lambda r: row_slots[r]), span

    def _prefill(self, prompts, cached, slots) -> torch.Tensor:
        """Run each row's new tokens (after its cached prefix) through the model into its slot; return
        the last position's logits [n, V]. Rows are batched by new-token length (a bucket pads at most
        a quarter of its real tokens; pads come first and are neither written nor attended), and rows
        that share a fresh prompt (a group's G trajectories at step 1) run it once: the others copy it."""
        device = self.device
        first: dict[tuple, int] = {}
        for i, (p, c) in enumerate(zip(prompts, cached)):
            if c == 0:
                first.setdefault(tuple(p), i)
        runner = [first[tuple(p)] if c == 0 else i for i, (p, c) in enumerate(zip(prompts, cached))]
        runs = sorted(set(runner), key=lambda i: len(prompts[i]) - cached[i])
        row_logits: dict[int, torch.Tensor] = {}
        heads = self.model.config.get_text_config().num_attention_heads

        def fits(rows: list[int]) -> bool:  # a bucket's attention scores (fp32, every query head) stay under 256 MB
            new, kv = max(len(prompts[i]) - cached[i] for i in rows), max(len(prompts[i]) for i in rows)
            return len(rows) * new * kv * heads * 4 <= 256 << 20

        for bucket in _length_buckets(runs, lambda i: len(prompts[i]) - cached[i], fits):
            new = [len(prompts[i]) - cached[i] for i in bucket]
            b, M = len(bucket), max(new)
            ids = torch.full((b, M), self.pad_id, dtype=torch.long)
            qpos = torch.zeros((b, M), dtype=torch.long)
            w_slot, w_pos, w_from = [], [], []
            for j, (i, m) in enumerate(zip(bucket, new)):
                c = cached[i]
                ids[j, M - m:] = torch.tensor(prompts[i][c:])
                qpos[j, M - m:] = torch.arange(c, c + m)
                w_slot += [slots[i]] * m
                w_pos += range(c, c + m)
                w_from += range(j * M + M - m, j * M + M)
            self.prefill_tokens += sum(new)
            self.prefill_pad_tokens += b * M - sum(new)
            t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
            out = self._forward(ids.to(device), qpos.to(device), t([slots[i] for i in bucket]), _span([slots[i] for i in bucket]),
                                write=(t(w_slot), t(w_pos)), write_from=None if b * M == len(w_from) else t(w_from),
                                kv_len=max(len(prompts[i]) for i in bucket))
            for j, i in enumerate(bucket):
                row_logits[i] = out[j]
        for i, r in enumerate(runner):
            if r != i:
                self.store.copy_slot(slots[r], slots[i], len(prompts[i]))
        return torch.stack([row_logits[r] for r in runner])

    def _forward(self, ids, qpos, row_slots, span, write_from, kv_len, write=None) -> torch.Tensor:
        """One forward of `ids` [b, M] at positions `qpos` over the rows' slots; returns the last position's logits."""
        if write is None:  # a decode step: each row writes its one token at its position
            write = (row_slots, qpos[:, 0])
        keys = torch.arange(kv_len, device=ids.device)
        mask = (keys[None, None, :] <= qpos[:, :, None])[:, None]  # [b, 1, M, kv_len]: causal, per-row length
        self.store.begin(row_slots, span, write[0], write[1], write_from, kv_len)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=qpos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kwarg: self.store})
        return out.logits[:, -1].float()


class _Anonymous:
    """The key of a row the caller did not name: released when its call ends."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


def _span(slots: list[int]) -> int | None:
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


def row_uniforms(seeds: torch.Tensor, t: int) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of (seed, token index t): 48 bits from two hashes
    (float64). The same on every device and whatever the batch."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(lo ^ _mix32(hi ^ _mix32(torch.full_like(seeds, t) ^ 0x9E3779B9)))
    a = _mix32(key ^ 0x85EBCA6B) >> 8  # 24 bits
    b = _mix32(key ^ 0xC2B2AE35) >> 8  # 24 more
    return ((a * (1 << 24) + b).double() + 0.5) / float(1 << 48)


def _choose(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, t: int) -> torch.Tensor:
    """The next token of every row: argmax (greedy), else inverse-CDF sampling of softmax(logits / T)
    (top-p: the smallest set of most likely tokens reaching top_p) with the row's own uniform."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = None
    if params.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs > params.top_p, 0.0)
    cdf = probs.cumsum(-1)
    u = row_uniforms(seeds, t) * cdf[:, -1]
    # the first token whose CDF reaches u: never one of zero probability (u > 0, flat steps are skipped)
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=cdf.shape[1] - 1).squeeze(1)
    return pick if order is None else order.gather(1, pick[:, None]).squeeze(1)


def _length_buckets(rows: list[int], length, fits=None, waste: float = 0.25) -> list[list[int]]:
    """Split rows sorted by length into runs that each pad at most `waste` of their real tokens
    when padded to their longest row (and, given `fits(rows)`, stay small enough)."""
    buckets: list[list[int]] = []
    for i in rows:
        if buckets:
            b = buckets[-1]
            total = sum(length(r) for r in b) + length(i)
            if (len(b) + 1) * length(i) - total <= waste * total and (fits is None or fits(b + [i])):
                b.append(i)
                continue
        buckets.append([i])
    return buckets
