"""The PREVIOUS transformers sampler (agentrl up to commit 813abdf), kept only so that
benchmarks/bench_sampler.py can measure the new engine against it side by side. Not part of
the product: nothing under src/ imports it.

Original docstring: transformers sampler: batched, left-padded decoding with a KV cache and per-row seeds.

We decode with our own loop rather than `model.generate` because the contract needs
per-sequence seeds (trajectory i of a task samples the same tokens whatever else is in the
batch) and the raw log-prob of every generated token. Finished rows leave the batch (their
cache rows are dropped), so one long answer does not make the others pay.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer

from agentrl.errors import UserError
from agentrl.sampling.base import Completion, SamplingParams


def stop_token_ids(tokenizer, model=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        ids.add(tid)
    return {i for i in ids if i is not None}


class HFSampler:
    def __init__(self, model, tokenizer, batch_size: int = 64, adapter: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.adapter_version: int | None = None
        self._kv: dict = {}  # key -> (ids fed to the model, per-layer (k, v) without pads)
        self._kv_older: dict = {}  # caches of keys the last call did not continue
        self.prefill_tokens = 0  # prompt tokens run through the model (not counting reused ones)
        self.reused_tokens = 0  # prompt tokens served from a kept KV cache
        self.prefill_pad_tokens = 0  # pads run beside them to batch rows of unequal length
        # longest prompt + completion: the model's position limit (the rollout ends episodes before it)
        self.max_model_len: int | None = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if adapter:
            self.load_adapter(adapter, version=0)

    def sleep(self) -> None:
        """Nothing to give back: the model shares its device with the learner as it is."""

    @classmethod
    def from_config(cls, cfg, model=None, tokenizer=None, colocated: bool = False) -> "HFSampler":
        if model is None or tokenizer is None:
            from agentrl.models import load_model

            model, tokenizer = load_model(cfg.model.name, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)
        return cls(model, tokenizer, batch_size=cfg.sampling.batch_size, adapter=cfg.model.adapter)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_adapter(self, path: str, version: int | None = None) -> None:
        from peft import PeftModel

        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise UserError(f"adapter directory {p} has no adapter_config.json (not a PEFT adapter)")
        name = f"v{version if version is not None else 0}"
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
                self.model = PeftModel.from_pretrained(self.model, str(p), adapter_name=name, is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UserError(f"adapter {p} does not fit the base model: {first}") from None
        self.model.eval()
        self.adapter_version = version
        self._kv, self._kv_older = {}, {}  # caches computed with the old weights are stale

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None, keys: list | None = None
    ) -> list[Completion]:
        """`keys[i]` names the sequence prompt i continues (e.g. a trajectory): its KV cache from the
        previous call is reused when that call's ids are a prefix of the prompt, so a multi-turn
        step prefills only the new observation. A key's cache lives until it misses two calls in a
        row (the rollout alternates two waves of trajectories)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError("one key per prompt")
        previous = {**self._kv_older, **self._kv}
        continued = set(keys or ())
        self._kv_older = {k: v for k, v in self._kv.items() if k not in continued}
        self._kv = {}
        out: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            chunk_seeds = None if seeds is None else seeds[start:end]
            chunk_keys = None if keys is None else keys[start:end]
            out.extend(self._generate_batch(prompts[start:end], params, chunk_seeds, chunk_keys, previous))
        return out

    def _reusable(self, prompt: list[int], key, previous: dict) -> tuple[int, list | None]:
        entry = previous.get(key) if key is not None else None
        if entry is None:
            return 0, None
        ids, kv = entry
        if len(ids) < len(prompt) and prompt[: len(ids)] == ids:
            return len(ids), kv
        return 0, None

    def _generate_batch(self, prompts, params: SamplingParams, seeds, keys, previous) -> list[Completion]:
        n, device = len(prompts), self.device
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        reuse = [self._reusable(p, None if keys is None else keys[i], previous) for i, p in enumerate(prompts)]
        logits, cache, attention = self._prefill(prompts, reuse, room=params.max_new_tokens)
        step_pos = torch.tensor([[len(p) - 1] for p in prompts], device=device)
        generators = None
        if not params.greedy:
            generators = [torch.Generator(device=device) for _ in range(n)]
            for g, s in zip(generators, seeds if seeds is not None else torch.randint(0, 2**62, (n,)).tolist()):
                g.manual_seed(int(s))

        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reason = ["length"] * n
        active = list(range(n))  # original row index of each row still in the batch
        for _ in range(params.max_new_tokens):
            raw_logp = torch.log_softmax(logits, dim=-1)
            chosen = self._choose(logits, params, [generators[i] for i in active] if generators else None)
            keep = []
            for row, orig in enumerate(active):
                tok = int(chosen[row])
                tokens[orig].append(tok)
                logps[orig].append(float(raw_logp[row, tok]))
                if tok in self.stop_ids:
                    reason[orig] = "stop"
                else:
                    keep.append(row)
            if len(tokens[active[0]]) == params.max_new_tokens:
                keep = []  # budget spent: every row leaves
            if keys is not None:
                for row in set(range(len(active))) - set(keep):
                    self._save(keys[active[row]], prompts[active[row]] + tokens[active[row]][:-1], cache, attention, row)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=device)
                cache.batch_select_indices(idx)
                attention, chosen, step_pos = attention[idx], chosen[idx], step_pos[idx]
                active = [active[r] for r in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
            step_pos = step_pos + 1
            logits = self.model(
                input_ids=chosen.view(-1, 1), attention_mask=attention, position_ids=step_pos,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1].float()
        return [
            Completion(
                prompt_ids=list(prompts[i]),
                token_ids=tokens[i],
                logprobs=logps[i],
                text=self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                finish_reason=reason[i],
                adapter_version=self.adapter_version,
            )
            for i in range(n)
        ]

    def _prefill(self, prompts, reuse, room: int):
        """Run each prompt's new tokens through the model and stack the rows, left-padded, into one
        cache for decoding with `room` free positions per row. Rows are batched by new-token length
        (a bucket pads at most a quarter of its real tokens): each row's new tokens sit right after
        its own cached prefix, pads go between the two and the attention mask skips them, so a
        bucket is one forward however its rows' cached lengths differ. Identical prompts (the G
        rows of a group at step 1) are run once and shared.
        Returns (last-position logits [n, V], cache, attention mask [n, W])."""
        from transformers import DynamicCache

        device = self.device
        self.reused_tokens += sum(c for c, _ in reuse)
        first: dict[tuple, int] = {}  # (prompt, cached length) -> the row that runs it
        for i, (c, _) in enumerate(reuse):
            first.setdefault((tuple(prompts[i]), c), i)
        runs = sorted(first.values(), key=lambda i: len(prompts[i]) - reuse[i][0])
        row_logits, row_kv = {}, {}
        for bucket in _length_buckets(runs, lambda i: len(prompts[i]) - reuse[i][0]):
            cached = [reuse[i][0] for i in bucket]
            new = [len(prompts[i]) - c for i, c in zip(bucket, cached)]
            W, M = max(cached), max(new)
            ids = torch.full((len(bucket), M), self.pad_id, dtype=torch.long)
            pos = torch.zeros((len(bucket), M), dtype=torch.long)
            attention = torch.zeros((len(bucket), W + M), dtype=torch.long)
            for j, (i, c, m) in enumerate(zip(bucket, cached, new)):
                ids[j, M - m :] = torch.tensor(prompts[i][c:])
                pos[j, M - m :] = torch.arange(c, c + m)
                attention[j, W - c : W] = 1
                attention[j, W + M - m :] = 1
            self.prefill_tokens += sum(new)
            self.prefill_pad_tokens += len(bucket) * M - sum(new)
            past = None
            if W:
                past, shapes = [], next(reuse[i][1] for i in bucket if reuse[i][0])
                for layer, (k0, v0) in enumerate(shapes):
                    k = k0.new_zeros((len(bucket), k0.shape[1], W, k0.shape[3]))
                    v = v0.new_zeros((len(bucket), v0.shape[1], W, v0.shape[3]))
                    for j, (i, c) in enumerate(zip(bucket, cached)):
                        if c:
                            k[j, :, W - c :] = reuse[i][1][layer][0][0]
                            v[j, :, W - c :] = reuse[i][1][layer][1][0]
                    past.append((k, v))
            cache = DynamicCache(ddp_cache_data=past) if past else DynamicCache()
            attention = attention.to(device)
            out = self.model(input_ids=ids.to(device), attention_mask=attention, position_ids=pos.to(device),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            for j, i in enumerate(bucket):
                row_logits[i] = out.logits[j, -1].float()
                keep = attention[j].nonzero().squeeze(-1)
                row_kv[i] = [(layer.keys[j, :, keep], layer.values[j, :, keep]) for layer in cache.layers]
        runner = [first[(tuple(p), c)] for p, (c, _) in zip(prompts, reuse)]
        width = max(len(p) for p in prompts)
        attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            attention[i, width - len(p) :] = 1
        layers = []
        for layer, (k0, v0) in enumerate(row_kv[runner[0]]):
            k = k0.new_zeros((len(prompts), k0.shape[0], width + room, k0.shape[2]))
            v = v0.new_zeros((len(prompts), v0.shape[0], width + room, v0.shape[2]))
            for i, p in enumerate(prompts):
                k[i, :, width - len(p) : width] = row_kv[runner[i]][layer][0]
                v[i, :, width - len(p) : width] = row_kv[runner[i]][layer][1]
            layers.append(_RoomyLayer(k, v, width))
        return torch.stack([row_logits[r] for r in runner]), Cache(layers=layers), attention

    def _save(self, key, fed_ids: list[int], cache, attention: torch.Tensor, row: int) -> None:
        """Keep one row's cache, pads removed, for the next call on the same key."""
        idx = attention[row].nonzero().squeeze(-1)
        kv = [(layer.keys[row : row + 1, :, idx].clone(), layer.values[row : row + 1, :, idx].clone()) for layer in cache.layers]
        assert kv[0][0].shape[2] == len(fed_ids), (kv[0][0].shape, len(fed_ids))
        self._kv[key] = (list(fed_ids), kv)

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams, generators) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        picks = [torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)]
        return torch.cat(picks)


def _length_buckets(rows: list[int], length, waste: float = 0.25) -> list[list[int]]:
    """Split rows sorted by length into runs that each pad at most `waste` of their real tokens
    when padded to their longest row."""
    buckets: list[list[int]] = []
    for i in rows:
        if buckets:
            b = buckets[-1]
            total = sum(length(r) for r in b) + length(i)
            if (len(b) + 1) * length(i) - total <= waste * total:
                b.append(i)
                continue
        buckets.append([i])
    return buckets


class _RoomyLayer(DynamicLayer):
    """A cache layer whose keys and values sit in a buffer with room for the tokens still to be
    decoded: each decode step writes its column in place, where DynamicLayer copies the whole
    cache (torch.cat) at every token, the largest cost of CPU decoding after the matmuls."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self._k, self._v, self.length = keys, values, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        if self.length + m > self._k.shape[2]:  # out of room: grow like DynamicLayer
            self._k = torch.cat([self.keys, key_states], dim=-2)
            self._v = torch.cat([self.values, value_states], dim=-2)
        else:
            self._k[:, :, self.length : self.length + m] = key_states
            self._v[:, :, self.length : self.length + m] = value_states
        self.length += m
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()
