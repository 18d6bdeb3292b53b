"""transformers sampler: the slot KV engine, a device-side token loop, per-row seeds.

We decode with our own loop rather than `model.generate` because the contract needs per-row
seeds (trajectory i of a task samples the same tokens whatever else is in the batch), the raw
log-prob of every generated token, and KV reuse across the turns of a trajectory.

- Memory: every live trajectory owns a slot of one KV store (`kv.SlotStore`, its tensors a
  `kv.KVStorage`): a turn writes its new tokens after the cached prefix, a finished
  trajectory's slot is reused at once.
- Attention: transformers' own model code with a registered attention function over the slot
  rows (per-row lengths, query heads grouped per KV head).
- The token loop (decode.py: `DecodeState`, `decode_step`, `compact`) keeps everything on the
  device: log-probs gathered there, stop tokens found with `isin`, finished rows stay in the
  batch (masked) until a sync point (every token on a CPU, where a sync is free; every 8 on a
  GPU), where they leave it by swapping slots with running rows, so the batch stays in
  consecutive slots; results come to the host in one transfer.
- Constrained rows (admissible actions) take their forced tokens without a forward of their own
  and feed them with the next one (jump.py, `sampling.jump_forward`): about a fifth of the
  forwards a reply's tokens would need, the same replies and log-probs.
- Sampling is batched and reproducible per row (decode.py: a counter-based uniform per (seed,
  token index)), so a row's tokens never depend on its neighbours in the batch.
- The adapter is merged into the sampler's weights (PEFT's merge): an unmerged LoRA on the seven
  projections nearly doubles the ops a forward dispatches (the default model with an r 32
  adapter: 13.2k vs 7.1k aten calls, nested ones included), and dispatch is what bounds the
  loop on a GPU. A hot-swap copies the saved base weights back before the next merge, so swaps
  never accumulate rounding.
- Full fine-tuning's weights (`WeightsRef` kind "full") are copied into the resident parameters
  in place, cast to the sampler's dtype: every parameter keeps its storage, so the KV store and a
  captured decode step stay valid, and nothing is reallocated.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from agentrl.errors import UserError
from agentrl.models import contiguous_head, copy_full_weights, load_model, quiet_peft
from agentrl.procmem import reused_heap
from agentrl.sampling.attention import check_backend, decode_kernel_for, prefill_kernel_for, prefill_sizer, sdpa_backend
from agentrl.sampling.base import Completion, GenRequest, SamplingParams, check_requests
from agentrl.sampling.budget import kv_budget_bytes
from agentrl.sampling.compat import servable_length
from agentrl.sampling.decode import DecodeState, compact, decode_step, row_uniforms, span_of
from agentrl.sampling.jump import decode_jump
from agentrl.sampling.kv import ForwardMeta, SlotStore, SlotView, batch_bucket, left_padded, round_up, use_slot_attention
from agentrl.sampling.prefixes import shared_prefixes
from agentrl.sampling.static import StaticDecoder, decode_static, kv_read_bucket
from agentrl.weights import WeightsRef

__all__ = ["HFSampler", "cache_kwarg", "row_uniforms", "stop_token_ids"]  # row_uniforms: decode.py's, re-exported

log = logging.getLogger(__name__)

# with prefill_buckets, a prefill forward may pad this many tokens beyond a quarter of its real
# ones: on a GPU ~4 TFLOP at most for the default model (a few ms), less than one more eager forward
PREFILL_PAD_TOKENS = 16384


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
                 kv_budget_gb: float | str | None = "auto", sync_every: int | None = None, merge_adapter: bool = True,
                 static_decode: str = "auto", attention_backend: str = "auto", share_prefixes: bool = True,
                 prefill_buckets: str = "auto", jump_forward: bool = True, decode_attention: str = "auto",
                 prefill_attention: str = "auto"):
        self.max_model_len: int | None = servable_length(model.config)  # refuses a model it cannot serve exactly
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.sync_every = sync_every  # tokens between host syncs (None: every token on a CPU, 8 on a GPU)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.adapter_version: int | None = None
        self.serves_full = False  # the resident weights were replaced by a full version (kind "full")
        self.cache_kwarg = cache_kwarg(model)  # read once: the forward's signature does not change with an adapter
        self.merge_adapter = merge_adapter  # serve the adapter merged into the weights (False: PEFT's LoRA layers)
        self._base_weights: dict[str, torch.Tensor] = {}  # each LoRA layer's base weight before any merge (host memory)
        contiguous_head(model)  # a prefill's last-position logits through mm, not a bmm copying the head per row
        param = next(model.parameters())
        # the captured decode step (static.py): auto = on where CUDA is; "on" runs the same step eagerly on a CPU
        on = static_decode == "on" or (static_decode == "auto" and param.device.type == "cuda")
        self.static = StaticDecoder(capture=param.device.type == "cuda") if on else None
        self.store = SlotStore(model.config, param.dtype, param.device, kv_budget_bytes(kv_budget_gb, param.device),
                               hold_still=on)
        self.attention_backend = check_backend(attention_backend, param.device, param.dtype, model.config)  # SDPA's kernel
        self._prefill_fits = prefill_sizer(self.attention_backend, param.device, param.dtype, model.config)
        # a decode step's and a prefill's attention: agentrl's CPU kernel (cpu_attention.py) or SDPA
        self.decode_kernel = decode_kernel_for(decode_attention, self.attention_backend, param.device)
        self.prefill_kernel = prefill_kernel_for(prefill_attention, self.attention_backend, param.device, param.dtype,
                                                 model.config)
        # prefill forwards of bucketed shapes (`prefill_shape`): auto = on where CUDA is, on = also on a CPU (tests)
        self.prefill_buckets = prefill_buckets == "on" or (prefill_buckets == "auto" and param.device.type == "cuda")
        self.prefill_forwards = 0  # prefill forwards run
        # constrained rows take their forced tokens without a forward of their own (jump.py; the eager loop only)
        self.jump_forward = jump_forward
        self.decode_forwards = 0  # the eager loops' forwards after the prefill (the captured step's: static.replays)
        self.forced_tokens = 0  # tokens the jump-forward loop took without a forward of their own
        self.prefill_shapes: set[tuple[int, int, int]] = set()  # their distinct (rows, new tokens, KV length)
        self.prefill_tokens = 0  # prompt tokens run through the model (not counting reused ones)
        self.reused_tokens = 0  # prompt tokens served from a kept KV cache
        self.prefill_pad_tokens = 0  # pads run beside them to batch rows of unequal length
        self.shared_prefix_tokens = 0  # prompt tokens copied from another fresh row's shared prefix
        self.share_prefixes = share_prefixes  # fresh prompts that begin alike run their prefix once
        self.min_shared_prefix = 16  # shorter shared prefixes are not worth a forward of their own
        self._anonymous = 0
        if adapter:
            self.load(WeightsRef.of(adapter, 0))  # a LoRA adapter or a full model directory

    def sleep(self) -> None:
        """Nothing to give back: the model shares its device with the learner as it is."""

    def close(self) -> None:
        """Nothing held outside this process."""

    @classmethod
    def from_config(cls, cfg, model=None, tokenizer=None, colocated: bool = False) -> "HFSampler":
        if model is None or tokenizer is None:
            model, tokenizer = load_model(cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)
        return cls(model, tokenizer, batch_size=cfg.sampling.batch_size, adapter=cfg.model.adapter,
                   kv_budget_gb=cfg.sampling.kv_budget_gb, merge_adapter=cfg.sampling.merge_adapter,
                   static_decode=cfg.sampling.static_decode, attention_backend=cfg.sampling.attention_backend,
                   share_prefixes=cfg.sampling.share_prefixes, prefill_buckets=cfg.sampling.prefill_buckets,
                   jump_forward=cfg.sampling.jump_forward, decode_attention=cfg.sampling.decode_attention,
                   prefill_attention=cfg.sampling.prefill_attention)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _stop_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(self.stop_ids), device=self.device)

    def load(self, weights: WeightsRef) -> None:
        """Serve the PEFT adapter `weights` names, merged into the resident base model (kind "full":
        the weights copied into the resident model in place, `_load_full`)."""
        p, version = Path(weights.path), weights.version
        if weights.kind == "full":
            return self._load_full(p, version)
        if self.serves_full:
            raise UserError(f"the sampler serves full weights (v{self.adapter_version}); adapter {p} applies to the base "
                            "model, which is no longer resident: start a new sampler for it")
        if not (p / "adapter_config.json").is_file():
            raise UserError(f"adapter directory {p} has no adapter_config.json (not a PEFT adapter)")
        name = f"v{version}"
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
                if self.static:
                    self.static.forget()  # a new model object: steps are rebuilt around it (once)
        except (RuntimeError, ValueError, KeyError) as e:
            self._merge()  # the previous adapter stays, as it was served
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UserError(f"adapter {p} does not fit the base model: {first}") from None
        self._merge()
        self.model.eval()
        self.adapter_version = version
        self.store.release(list(self.store.slot_of))  # caches computed with the old weights are stale

    def _load_full(self, p: Path, version: int) -> None:
        """Serve a full model directory: an adapter in use is restored away (its base weights copied
        back), every parameter takes the saved tensor in place, then PEFT's layers are unloaded (the
        base modules keep their parameters). A directory that does not fit changes nothing."""
        peft = isinstance(self.model, PeftModel)
        self._unmerge()
        try:
            copy_full_weights(self.model, p, _plain_names(self.model) if peft else None)
        except UserError:
            self._merge()  # the previous weights stay, as they were served
            raise
        if peft:
            with quiet_peft():
                self.model = self.model.unload()
            self._base_weights = {}
            if self.static:
                self.static.forget()  # a new model object: steps are rebuilt around it (once)
        self.model.eval()
        self.serves_full = True
        self.adapter_version = version
        self.store.release(list(self.store.slot_of))  # caches computed with the old weights are stale

    def _serves_merged(self) -> bool:
        """The weights served are plain tensors (no adapter, or one merged): what a captured step can replay."""
        return all(m.merged for _, m in self._lora_layers())

    def _lora_layers(self) -> list:
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

    def rows_that_fit(self, tokens_per_row: int) -> int | None:
        """How many sequences of `tokens_per_row` tokens the KV budget holds at once."""
        return int(self.store.budget // max(1, tokens_per_row * self.store.bytes_per_token)) if self.store.budget else 1 << 30

    def reserve(self, rows: int, tokens_per_row: int) -> None:
        """The store sized once for the plan (`SlotStore.reserve`: a reallocation drops the captured
        graphs, and on a CPU copies the whole store); rows past the plan grow it."""
        self.store.reserve(rows, tokens_per_row)

    def kv_memory(self) -> dict:
        s = self.store
        slots, capacity = s.storage.peak_shape
        return {"budget_bytes": s.budget, "peak_bytes": s.peak_bytes, "peak_slots": slots, "peak_capacity": capacity,
                "bytes_per_token": s.bytes_per_token, "dropped": s.dropped, "reallocations": s.storage.generation,
                "decode_steps_built": self.static.built if self.static else None,
                "prefill_forwards": self.prefill_forwards, "prefill_shapes": len(self.prefill_shapes),
                "prefill_tokens": self.prefill_tokens, "prefill_pad_tokens": self.prefill_pad_tokens,
                "decode_forwards": self.decode_forwards, "forced_tokens_jumped": self.forced_tokens}

    @torch.no_grad()
    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """The Sampler contract (base.py). `request.key` names the sequence the prompt continues (e.g.
        a trajectory): its cached tokens are reused when they are a prefix of the prompt, so a
        multi-turn step runs only the new observation. A key lives until `release`d, or until it
        misses two calls in a row (callers that never release; the rollout's two waves take turns)."""
        check_requests(requests, constraints=True)
        for r in requests:
            if r.constraint is not None:
                r.constraint.check_stops(self.stop_ids)
        prompts = [list(r.prompt_ids) for r in requests]
        seeds = [r.seed for r in requests]
        if any(s is None for s in seeds):  # drawn for every row, as before, so unseeded calls stay as random
            drawn = torch.randint(0, 2**62, (len(prompts),)).tolist()
            seeds = [d if s is None else s for s, d in zip(seeds, drawn)]
        names = self._names([r.key for r in requests])
        self.store.calls += 1
        stale = [k for k in self.store.stale() if k not in set(names)]
        if stale:  # (an empty release would give back a store reserved for this very batch)
            self.store.release(stale)
        out: list[Completion] = []
        try:
            # reused_heap: each token step's transient tensors come from the heap, not a fresh mmap (procmem.py)
            with use_slot_attention(self.model, self.decode_kernel, self.prefill_kernel), sdpa_backend(self.attention_backend), reused_heap():
                for start in range(0, len(prompts), self.batch_size):
                    end = start + self.batch_size
                    out.extend(self._generate_batch(prompts[start:end], params, seeds[start:end], names[start:end],
                                                    [r.constraint for r in requests[start:end]]))
        finally:
            self.store.release([n for n in names if isinstance(n, _Anonymous)])
        return out

    def _names(self, keys: list) -> list:
        """Each row's key in the store; rows without one (or a repeated one) get a key of their own for this call."""
        names, seen = [], set()
        for k in keys:
            if k is None or k in seen:
                self._anonymous += 1
                k = _Anonymous(self._anonymous)
            seen.add(k)
            names.append(k)
        return names

    # ------------------------------------------------------------------ one batch

    def _generate_batch(self, prompts, params: SamplingParams, seeds, names, constraints) -> list[Completion]:
        store = self.store
        cached = [store.reusable(k, p) for k, p in zip(names, prompts)]
        self.reused_tokens += sum(cached)
        slots = store.place(names, [len(p) + params.max_new_tokens for p in prompts])  # sized for the whole batch
        for k, c, p in zip(names, cached, prompts):
            store.hold(k, p[:c])
        with store.storage.pin():  # from here to the last token, the KV buffers stay as they are
            logits = self._prefill(prompts, cached, slots)
            for k, p in zip(names, prompts):
                store.hold(k, list(p))
            state = DecodeState.start(logits, slots, [len(p) for p in prompts], seeds, params.max_new_tokens, constraints)
            self._decode(state, params)
        return self._completions(state, prompts, names)

    def _decode(self, state: DecodeState, params: SamplingParams) -> None:
        """The token loop: a decode step per token, host syncs (and compaction) every `sync_every`.
        With static decoding on, the same loop over static steps (static.py; captured on CUDA)."""
        T, device, stop = params.max_new_tokens, self.device, self._stop_tensor
        every = self.sync_every or (1 if device.type == "cpu" else 8)  # a host sync is free on a CPU
        if self.static is not None and state.span is not None and self._serves_merged():
            return decode_static(self, state, params, every)
        if self.jump_forward and state.table is not None:
            return decode_jump(self, state, params, stop)
        for t in range(T):
            decode_step(state, t, params, stop)
            if t == T - 1:
                break
            if (t + 1) % every == 0:  # the only host syncs of the loop
                finished = state.done.tolist()
                alive = [r for r in state.active if not finished[r]]
                if not alive:
                    break
                if len(alive) < len(state.active) and (device.type == "cpu" or len(alive) <= len(state.active) // 2):
                    compact(state, alive, self.store, state.longest + t)
            self.decode_forwards += 1
            state.logits = self._forward(state.last[state.act][:, None], (state.pos[state.act] + t)[:, None],
                                         state.forward_meta(t))

    def _completions(self, state: DecodeState, prompts, names) -> list[Completion]:
        tokens, logps, length = state.tokens.cpu(), state.logps.cpu(), state.length.cpu()  # one transfer per batch
        out: list[Completion | None] = [None] * len(prompts)
        for r, i in enumerate(state.order):
            m = int(length[r])
            ids = tokens[r, :m].tolist()
            reason = "stop" if ids[-1] in self.stop_ids else "length"
            stored = m - 1 if state.fed is None else state.fed[r]  # the last token's keys are not computed yet
            self.store.hold(names[i], list(prompts[i]) + ids[:stored])
            out[i] = Completion(prompt_ids=list(prompts[i]), token_ids=ids, logprobs=logps[r, :m].tolist(),
                                text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=reason,
                                adapter_version=self.adapter_version)
        return out

    def _prefill(self, prompts, cached, slots) -> torch.Tensor:
        """Run each row's new tokens (after its cached prefix) through the model into its slot; return
        the last position's logits [n, V]. Rows are batched by new-token length (a bucket pads at most
        a quarter of its real tokens; pads come first and are neither written nor attended), and rows
        that share a fresh prompt (a group's G trajectories at step 1) run it once: the others copy it.
        Fresh prompts that only begin alike (the system message and a task type's example) run their
        shared prefix once too (`prefixes.shared_prefixes`), as vLLM's prefix caching does."""
        first: dict[tuple, int] = {}
        for i, (p, c) in enumerate(zip(prompts, cached)):
            if c == 0:
                first.setdefault(tuple(p), i)
        runner = [first[tuple(p)] if c == 0 else i for i, (p, c) in enumerate(zip(prompts, cached))]
        if self.share_prefixes:
            cached = self._run_shared_prefixes(prompts, cached, slots, sorted(set(first.values())))
        row_logits = self._prefill_rows(sorted(set(runner)), prompts, cached, slots)
        for i, r in enumerate(runner):
            if r != i:
                self.store.copy_slot(slots[r], slots[i], len(prompts[i]))
        return torch.stack([row_logits[r] for r in runner])

    def _prefill_rows(self, runs: list[int], prompts, cached, slots) -> dict[int, torch.Tensor]:
        """Each of `runs`' new tokens into its slot, in length buckets; {row: last position's logits}."""
        def fits(rows: list[int]) -> bool:  # a bucket's scores or, with a fused kernel, its tokens (attention.prefill_fits)
            new, kv = max(len(prompts[i]) - cached[i] for i in rows), max(len(prompts[i]) for i in rows)
            return self._prefill_fits(*self._shape(len(rows), new, kv))

        row_logits: dict[int, torch.Tensor] = {}
        runs = sorted(runs, key=lambda i: len(prompts[i]) - cached[i])
        pad = PREFILL_PAD_TOKENS if self.prefill_buckets else 0
        for bucket in _length_buckets(runs, lambda i: len(prompts[i]) - cached[i], fits, pad_tokens=pad):
            bucket.sort(key=lambda i: slots[i])  # rows in slot order: a bucket of consecutive slots reads them as a view
            out = self._prefill_bucket(bucket, prompts, cached, slots)
            for j, i in enumerate(bucket):
                row_logits[i] = out[j]
        return row_logits

    def _shape(self, rows: int, new: int, kv: int) -> tuple[int, int, int]:
        """The (rows, new tokens, KV length) a prefill forward of that size runs at."""
        return prefill_shape(rows, new, kv, self.store.capacity) if self.prefill_buckets else (rows, new, kv)

    def _run_shared_prefixes(self, prompts, cached, slots, fresh: list[int]) -> list[int]:
        """Run each shared prefix of the fresh rows once, in its first row's slot, copy it to the
        other rows' slots, and return `cached` with those rows starting after it. The copies hold the
        same keys and values a row's own prefill would write (same tokens, same positions)."""
        shared = shared_prefixes([prompts[i] for i in fresh], self.min_shared_prefix)
        if not shared:
            return cached
        cached = list(cached)
        leaders = {}
        for members, n in shared:
            rows = [fresh[j] for j in members]
            leaders[rows[0]] = n
            for i in rows:
                cached[i] = n
        heads = {i: prompts[i][:n] for i, n in leaders.items()}
        self._prefill_rows(list(heads), heads, dict.fromkeys(heads, 0), slots)
        for members, n in shared:
            rows = [fresh[j] for j in members]
            for i in rows[1:]:
                self.store.copy_slot(slots[rows[0]], slots[i], n)
            self.shared_prefix_tokens += n * (len(rows) - 1)
        return cached

    def _prefill_bucket(self, bucket: list[int], prompts, cached, slots) -> torch.Tensor:
        """One forward of a bucket's new tokens, left-padded to its longest (with `prefill_buckets`: to
        its shape's bucket, and padding rows after the real ones, which read one slot and write
        nothing); the real rows' last position's logits."""
        new = [len(prompts[i]) - cached[i] for i in bucket]
        b = len(bucket)
        B, M, kv = self._shape(b, max(new), max(len(prompts[i]) for i in bucket))
        self.prefill_tokens += sum(new)
        self.prefill_pad_tokens += B * M - sum(new)
        self.prefill_forwards += 1
        self.prefill_shapes.add((B, M, kv))
        read = [slots[i] for i in bucket]
        span = span_of(read)
        if B > b:  # padding rows: the slots after a span where the store has them, else the scratch (or first) slot
            if span is not None and span + B <= self.store.slots:
                read = list(range(span, span + B))
            else:
                span = None
                read += [self.store.scratch if self.store.scratch is not None else read[0]] * (B - b)
        rows = [(slots[i], prompts[i][cached[i]:], cached[i]) for i in bucket]
        return self._forward(*left_padded(rows, (B, M), self.pad_id, read, span, kv, self.device))[:b]

    def _forward(self, ids: torch.Tensor, qpos: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """One forward of `ids` [b, M] at positions `qpos` over the slots `meta` names; the last position's logits."""
        keys = torch.arange(meta.kv_len, device=ids.device)
        mask = (keys[None, None, :] <= qpos[:, :, None])[:, None]  # [b, 1, M, kv_len]: causal, per-row length
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=qpos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kwarg: SlotView(self.store.storage, meta)})
        return out.logits[:, -1].float()


def _plain_names(model: PeftModel) -> dict:
    """A PEFT-wrapped model's base parameters by the names the plain model gives them (LoRA's own left out)."""
    return {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
            for n, p in model.named_parameters(remove_duplicate=False) if ".lora_" not in n}


class _Anonymous:
    """The key of a row the caller did not name: released when its call ends."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


def _length_buckets(rows: list[int], length, fits=None, waste: float = 0.25, pad_tokens: int = 0) -> list[list[int]]:
    """Split rows sorted by length into runs that each pad at most `waste` of their real tokens, or
    `pad_tokens` if more, when padded to their longest row (and, given `fits(rows)`, stay small enough)."""
    buckets: list[list[int]] = []
    for i in rows:
        if buckets:
            b = buckets[-1]
            total = sum(length(r) for r in b) + length(i)
            if (len(b) + 1) * length(i) - total <= max(waste * total, pad_tokens) and (fits is None or fits(b + [i])):
                b.append(i)
                continue
        buckets.append([i])
    return buckets


def prefill_shape(rows: int, new: int, kv: int, capacity: int) -> tuple[int, int, int]:
    """A prefill forward's bucketed shape: rows as the decode step's batch buckets, new tokens to a
    multiple of 16 (of 128 past 256), the KV length to the decode step's 256-position buckets
    (never past the store's capacity). On a GPU an eager forward costs its ~1,000 launches
    whatever its size, and SDPA's cuDNN kernel builds a plan for each shape it has not seen (~47
    ms of host time on an H100, issue 47): a step's prefill of new observations, whose lengths
    differ from row to row and grow every step, otherwise runs several forwards of new shapes."""
    return batch_bucket(rows), round_up(new, 16 if new <= 256 else 128), kv_read_bucket(kv, capacity)
