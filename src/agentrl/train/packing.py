"""Sequence packing and token-budgeted micro-batches: the learner's forward without padding.

Sequences of one micro-batch are concatenated into rows (first-fit-decreasing by length), each
with its own position ids restarting at 0. transformers (>= 4.57's masking_utils) reads a restart
of the position ids, with no 2D attention mask and no cache, as packed sequences: every
attention implementation then attends within each sequence only (sdpa and eager: a
block-diagonal causal mask; flash-attention: its variable-length kernel). RoPE sees the same
positions as unpacked, so each sequence's log-probs are those of its own forward, to float
round-off (tests/test_packing.py holds them to 1e-5 in fp32).

A row's tail after its last sequence (FFD leaves little) is filler, one more "sequence" that
attends to itself and is never read. Rows are as wide as the longest sequence: sdpa and eager
compute the whole block-diagonal mask, O(row^2), so a wider row spends on attention what packing
saves on padding (on the CPU a 2,048-token row of three walkthroughs took 3-6x the attention
time of the three alone; the learner's sequences differ in length, so rows of the longest
still fill).

Sequences of a micro-batch that begin alike (a group's G trajectories share their first prompt,
~500 tokens of ~1,450 at T_max 30) run as a fork (`fork`, `learner.share_prefixes`): the shared
prefix is forwarded once, with grad, and each suffix (right-padded) against its keys and values
expanded over the rows, so every suffix's gradient flows into the one prefix forward. A prefix
stops before any row's first action token, so it is never projected onto the vocabulary; a fork is
taken only where it computes fewer tokens than the layout it replaces.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from agentrl.sampling.prefixes import shared_prefixes
from agentrl.train.loss import chunked_logprobs

# the attention implementations whose masks transformers builds from packed position ids
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention",
                     "agentrl_learner")  # train/attention.py's: SDPA's mask


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` packed into rows of at most `capacity` tokens: longest first, each into
    the first row with room (a longer sequence gets a row of its own). Deterministic."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for r, left in enumerate(room):
            if n <= left:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


def row_capacity(lengths: list[int]) -> int:
    """A packed row's width: the longest sequence's (a row never costs more attention than padding it would)."""
    return max(lengths, default=1)


def token_micro_batches(lengths: list[int], token_budget: int, pack: bool = True) -> list[list[list[int]]]:
    """Micro-batches (each a list of rows, each a list of indices into `lengths`) holding at most
    `token_budget` tokens as computed (rows x the widest row), one row at least. `pack`: rows are
    packed by first-fit-decreasing; else one sequence per row, rows of similar length together
    (the padded path)."""
    if not lengths:
        return []
    if pack:
        rows = first_fit_decreasing(lengths, row_capacity(lengths))
    else:
        rows = [[i] for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))]
    fill = [sum(lengths[i] for i in row) for row in rows]
    out: list[list[list[int]]] = []
    width = 0
    for row, n in sorted(zip(rows, fill), key=lambda rf: -rf[1]):  # widest first: a batch's width is its first row's
        if out and (len(out[-1]) + 1) * max(width, n) <= token_budget:
            out[-1].append(row)
        else:
            out.append([row])
            width = n
    return out


@dataclass
class Packed:
    """A micro-batch as model inputs. `spans[k]` = (row, start, length) of the k-th sequence."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor | None  # [R, W], restarting per sequence (None: padded rows)
    attention_mask: torch.Tensor | None  # [R, W] for padded rows (None: packed)
    spans: list[tuple[int, int, int]]
    allowed: torch.Tensor | None = None  # [R, W, A] ids the token at each position was drawn among (-1: free)

    def model_inputs(self) -> dict:
        if self.position_ids is not None:
            return {"input_ids": self.input_ids, "position_ids": self.position_ids}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def scatter(self, per_sequence: list[list[float]] | list[list[int]], dtype=torch.float32) -> torch.Tensor:
        """Per-token values of each sequence (e.g. action masks) laid out as the rows are."""
        out = torch.zeros(self.input_ids.shape, dtype=dtype)
        for (r, s, n), values in zip(self.spans, per_sequence):
            out[r, s : s + n] = torch.as_tensor(values, dtype=dtype)
        return out.to(self.input_ids.device)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, W] per-position values -> [N, longest] per sequence, right-padded with 0 (gradients flow)."""
        seqs = [rows[r, s : s + n] for r, s, n in self.spans]
        return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)


@dataclass
class Fork:
    """Sequences that begin alike: their shared prefix [1, P], run once, and their suffixes [M, S],
    right-padded, each run against the prefix's keys and values. `members`: their places in the
    micro-batch's sequence order."""

    members: list[int]
    prefix: torch.Tensor  # [1, P]
    suffixes: torch.Tensor  # [M, S]
    attention_mask: torch.Tensor  # [M, P + S]: the prefix and each suffix's own tokens
    lengths: list[int]  # each member's whole length (P + its suffix)
    allowed: torch.Tensor | None = None  # [M, S, A] as Packed.allowed, in the suffixes' layout

    @property
    def shared(self) -> int:
        return self.prefix.shape[1]


@dataclass
class Forked:
    """A micro-batch with forks: `forks`, and the other sequences packed as before (`rest`, None
    when every sequence is in a fork; `rest_members` their places in the micro-batch's order)."""

    forks: list[Fork]
    rest: Packed | None
    rest_members: list[int]
    lengths: list[int]  # every sequence's length, in the micro-batch's order


def pack(sequences: list[list[int]], rows: list[list[int]], device, packed: bool = True,
         constraints: list | None = None) -> Packed:
    """Model inputs for `rows` (lists of indices into `sequences`); spans come in sequence order
    (sequences[rows[0][0]] first ...). `packed` False: one sequence per row, right-padded.
    `constraints`: per sequence (action mask, allowed ids per action token) or None (`allowed_ids`)."""
    order = [i for row in rows for i in row]
    width = max(sum(len(sequences[i]) for i in row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros_like(ids)
    attn = torch.zeros_like(ids)
    spans: dict[int, tuple[int, int, int]] = {}
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(sequences[i])
            ids[r, start : start + n] = torch.as_tensor(sequences[i])
            pos[r, start : start + n] = torch.arange(n)
            attn[r, start : start + n] = 1
            spans[i] = (r, start, n)
            start += n
        pos[r, start:] = torch.arange(width - start)  # the tail: filler attending to itself
    ordered = [spans[i] for i in order]
    allowed = allowed_ids(ids.shape, [spans[i] for i in order], [constraints[i] for i in order], device) if constraints else None
    if packed:
        return Packed(ids.to(device), pos.to(device), None, ordered, allowed)
    return Packed(ids.to(device), None, attn.to(device), ordered, allowed)


def allowed_ids(shape, spans: list[tuple[int, int, int]], constraints: list, device) -> torch.Tensor | None:
    """[R, W, A]: at each position the ids its token was drawn among (admissible actions: the
    sampler's constraint, stored per action token as `allowed`), -1 where it was free. Each of
    `constraints` is (action mask, allowed per action token in order) or None; None when no
    position is constrained."""
    entries = []  # (row, position, ids)
    for (r, s, n), c in zip(spans, constraints):
        if not c or not c[1]:
            continue
        mask, allowed = c
        positions = [p for p in range(n) if mask[p]]
        if len(positions) != len(allowed):
            raise ValueError(f"{len(allowed)} allowed-id lists for {len(positions)} action tokens")
        entries += [(r, s + p, ids) for p, ids in zip(positions, allowed) if ids]
    if not entries:
        return None
    out = torch.full((*shape, max(len(ids) for _, _, ids in entries)), -1, dtype=torch.long)
    for r, q, ids in entries:
        out[r, q, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    return out.to(device)


def first_action(mask: list[int]) -> int:
    """The position of a sequence's first action token (its length when it has none)."""
    return next((t for t, m in enumerate(mask) if m), len(mask))


def fork(sequences: list[list[int]], rows: list[list[int]], masks: list[list[int]], device, packed: bool = True,
         constraints: list | None = None, min_prefix: int = 64) -> Packed | Forked:
    """`pack`'s micro-batch, with the sequences that begin alike run as forks (`Fork`). `masks`: the
    action masks, in the micro-batch's sequence order (rows flattened). A shared prefix (`prefixes.
    shared_prefixes` over each sequence up to its first action token: so it ends before any token a
    loss reads) of at least `min_prefix` tokens makes a fork when the fork computes fewer tokens than
    its members do in the layout it replaces (packed: their lengths; padded rows: the widest row each).
    No fork pays: `pack`'s Packed, unchanged."""
    order = [i for row in rows for i in row]
    lengths = [len(sequences[i]) for i in order]
    heads = [sequences[i][: first_action(m)] for i, m in zip(order, masks)]
    width = max(sum(len(sequences[i]) for i in row) for row in rows)
    forks, forked = [], set()
    for members, n in shared_prefixes(heads, min_prefix):
        members = sorted(members)
        widest = max(lengths[k] for k in members) - n
        now = sum(lengths[k] for k in members) if packed else width * len(members)
        if n + widest * len(members) >= now:
            continue
        forks.append(_fork(sequences, order, members, n, widest, device, constraints))
        forked.update(members)
    if not forks:
        return pack(sequences, rows, device, packed, constraints)
    rest_members = [k for k in range(len(order)) if k not in forked]
    place = {i: k for k, i in enumerate(order)}
    rest_rows = [r for r in ([i for i in row if place[i] not in forked] for row in rows) if r]
    rest = pack(sequences, rest_rows, device, packed, constraints) if rest_rows else None
    return Forked(forks, rest, rest_members, lengths)


def _fork(sequences, order, members: list[int], n: int, widest: int, device, constraints) -> Fork:
    seqs = [sequences[order[k]] for k in members]
    suffixes = torch.zeros((len(members), widest), dtype=torch.long)
    attn = torch.zeros((len(members), n + widest), dtype=torch.long)
    attn[:, :n] = 1
    for m, ids in enumerate(seqs):
        suffixes[m, : len(ids) - n] = torch.as_tensor(ids[n:])
        attn[m, n : len(ids)] = 1
    allowed = None
    if constraints:  # the suffix layout puts a sequence's position p at p - n (no action token lies before n)
        allowed = allowed_ids(suffixes.shape, [(m, -n, len(ids)) for m, ids in enumerate(seqs)],
                              [constraints[order[k]] for k in members], device)
    return Fork(members, torch.as_tensor(seqs[0][:n])[None].to(device), suffixes.to(device), attn.to(device),
                [len(ids) for ids in seqs], allowed)


def supports_packing(model) -> bool:
    """Whether the model's attention masks packed sequences from position ids (else: padded rows):
    transformers' own model code (its masks come from masking_utils; remote code may build its
    own and let packed sequences see each other) with one of PACKING_ATTENTION."""
    config = getattr(model, "config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (type(base).__module__.startswith("transformers.models.")
            and getattr(config, "_attn_implementation", None) in PACKING_ATTENTION)


def final_hidden(model, batch: Packed) -> torch.Tensor:
    """The final-norm hidden states [R, W, h] (no cache: packing needs none, and it is not kept)."""
    out = model(**batch.model_inputs(), use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def target_mask(batch: Packed, masks: list[list[int]]) -> torch.Tensor:
    """[R, W] bool: position p is trained when the token at p + 1 is in its sequence and masked 1
    (a sequence's last position would predict the next sequence's first token: never)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for (r, s, n), m in zip(batch.spans, masks):
        out[r, s : s + n - 1] = torch.as_tensor(m[1:n], dtype=torch.bool)
    return out.to(batch.input_ids.device)


def trained_hidden(model, batch: Packed | Forked, masks: list[list[int]]):
    """The final-norm hidden states where a loss reads them, for a packed or forked micro-batch:
    (hidden [K, h], targets [K], allowed [K, A] or None, (sequence, position) [K] each): the state
    that predicts token t of sequence k wherever its action mask is 1 (t >= 1), in some fixed order.
    `masks`: per sequence, in the micro-batch's order."""
    if isinstance(batch, Forked):
        return _forked_hidden(model, batch, masks)
    chosen = target_mask(batch, masks)  # hidden state at p predicts token p + 1 of its sequence
    hidden = final_hidden(model, batch)[chosen]
    targets = torch.roll(batch.input_ids, -1, dims=1)[chosen]
    allowed = None if batch.allowed is None else torch.roll(batch.allowed, -1, dims=1)[chosen]
    where = [(k, t) for k, ((_, _, n), m) in enumerate(zip(batch.spans, masks)) for t in range(1, n) if m[t]]
    return hidden, targets, allowed, _index(where, hidden.device)


def _forked_hidden(model, batch: Forked, masks: list[list[int]]):
    pieces = []
    if batch.rest is not None:
        h, y, a, (k, t) = trained_hidden(model, batch.rest, [masks[j] for j in batch.rest_members])
        pieces.append((h, y, a, (torch.as_tensor(batch.rest_members, device=k.device)[k], t)))
    for f in batch.forks:
        n = f.shared
        hidden = fork_hidden(model, f)
        chosen = torch.zeros(f.suffixes.shape, dtype=torch.bool)
        for m, k in enumerate(f.members):  # suffix position j predicts the member's token n + j + 1
            chosen[m, : f.lengths[m] - n - 1] = torch.as_tensor(masks[k][n + 1 : f.lengths[m]], dtype=torch.bool)
        chosen = chosen.to(hidden.device)
        targets = torch.roll(f.suffixes, -1, dims=1)[chosen]
        allowed = None if f.allowed is None else torch.roll(f.allowed, -1, dims=1)[chosen]
        row, j = chosen.nonzero(as_tuple=True)  # the order boolean indexing takes
        where = (torch.as_tensor(f.members, device=hidden.device)[row], j + n + 1)
        pieces.append((hidden[chosen], targets, allowed, where))
    hidden = torch.cat([p[0] for p in pieces])
    targets = torch.cat([p[1] for p in pieces])
    allowed = None
    if any(p[2] is not None for p in pieces):
        width = max(p[2].shape[1] for p in pieces if p[2] is not None)
        allowed = torch.cat([torch.nn.functional.pad(p[2], (0, width - p[2].shape[1]), value=-1) if p[2] is not None
                             else p[1].new_full((p[1].shape[0], width), -1) for p in pieces])
    return hidden, targets, allowed, (torch.cat([p[3][0] for p in pieces]), torch.cat([p[3][1] for p in pieces]))


def _index(where: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.as_tensor([w[0] for w in where], dtype=torch.long, device=device)
    return k, torch.as_tensor([w[1] for w in where], dtype=torch.long, device=device)


def fork_hidden(model, f: Fork) -> torch.Tensor:
    """[M, S, h] the final-norm hidden states of a fork's suffixes: the prefix forwarded once (its
    cache kept, with grad), its keys and values expanded over the M rows (a view: the suffix
    forward's concatenation is the only copy), then the suffixes at positions P.. against them."""
    from agentrl.sampling.hf import cache_kwarg  # the forward's name for the cache (transformers 5 renamed it)

    name = cache_kwarg(model)
    cache = getattr(model(input_ids=f.prefix, use_cache=True, logits_to_keep=1), name)
    rows = f.suffixes.shape[0]
    for layer in cache.layers:
        layer.keys = layer.keys.expand(rows, -1, -1, -1)
        layer.values = layer.values.expand(rows, -1, -1, -1)
    positions = (torch.arange(f.suffixes.shape[1], device=f.suffixes.device) + f.shared)[None].expand(rows, -1)
    out = model(input_ids=f.suffixes, attention_mask=f.attention_mask, position_ids=positions, use_cache=True,
                output_hidden_states=True, logits_to_keep=1, **{name: cache})
    return out.hidden_states[-1]


def sequence_logprobs(model, batch: Packed | Forked, chunk: int = 512, masks: list[list[int]] | None = None) -> torch.Tensor:
    """[N, longest] log p(token t | the sequence's tokens < t) per sequence, entry 0 = 0, right-padded
    with 0: what `loss.token_logprobs` gives for the same sequences unpacked. The vocabulary
    projection runs in chunks of `chunk` positions (recomputed in backward). Where the batch
    carries `allowed` ids (admissible actions) a log-prob is renormalised over them, as sampled.
    `masks` (per sequence, in the micro-batch's order: the action masks): only the tokens masked 1
    get their log-prob, every other entry is 0 (a forked batch needs them). The projection onto the
    vocabulary is about a quarter of a learn step's compute on the default model, and the losses
    read action tokens only."""
    lm_head = model.get_output_embeddings()
    if masks is not None:  # the trained positions only, gathered into one row; the same per-position numbers
        hidden, targets, allowed, (k, t) = trained_hidden(model, batch, masks)
        picked = chunked_logprobs(lm_head, hidden[None], targets[None], chunk, None if allowed is None else allowed[None])[0]
        lengths = batch.lengths if isinstance(batch, Forked) else [n for _, _, n in batch.spans]
        out = picked.new_zeros((len(lengths), max(lengths)))
        return out.index_put((k, t), picked)
    if isinstance(batch, Forked):
        raise ValueError("a forked micro-batch needs its action masks")
    hidden = final_hidden(model, batch)[:, :-1]
    allowed = None if batch.allowed is None else batch.allowed[:, 1:]  # the token at p + 1, predicted at p
    logp = chunked_logprobs(lm_head, hidden, batch.input_ids[:, 1:], chunk, allowed)
    # entry t of a sequence is predicted at its position t - 1: shift right by one within the row
    rows = torch.cat([logp.new_zeros((logp.shape[0], 1)), logp], dim=1)
    seqs = [torch.cat([rows.new_zeros(1), rows[r, s + 1 : s + n]]) for r, s, n in batch.spans]
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)


def autocast_dtype(setting: str, device) -> torch.dtype | None:
    """The dtype `learner.autocast` asks for on `device` (None: off). auto: bf16 on a CUDA device
    that has it, off elsewhere (CPU keeps fp32)."""
    device = torch.device(device)
    if setting == "off":
        return None
    if setting == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def autocast(setting: str, device):
    """The forward's autocast context (a no-op when off): matmuls in bf16 over fp32 weights and
    LoRA state; the loss's log-softmax stays fp32 (autocast's own rule, and `.float()` above)."""
    dtype = autocast_dtype(setting, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
