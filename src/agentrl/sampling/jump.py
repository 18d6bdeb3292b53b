"""Jump-forward decoding of forced tokens: the eager token loop for constrained rows (admissible
actions, constraint.py), which appends a forced token at once instead of running a forward for it.

Under the admissible action space most reply tokens are forced: one alive command continues with
them, their log-prob is exactly 0, and the model's logits there change nothing. Of the 7,101 reply
tokens of `make train`'s 120 warm-start walkthroughs (`Action: <command><end of turn>`, 10.0 a
reply, each against its step's own admissible commands) 81.3% are forced; a reply makes 1.87
choices (benchmarks/bench_forced_tokens.py). The token loop still runs one
forward per token. Here a row chooses a token from its logits, then takes every forced token after
it, and feeds them all to the model in its next forward: each row feeds its own number of tokens
(left-padded, as a prefill bucket; pads are neither written nor attended) and reads its logits at
its last one. A row whose reply is decided (the rest of its command and the end-of-turn token
forced) runs no forward after its last choice. Forwards per lockstep step: the most choices any
row makes, not the longest reply.

The same replies and log-probs as the token loop (decode.py): a forced token's log-prob is 0 either
way (the softmax renormalised over one token); a chosen token is drawn with the row's counter at
its own index (`row_uniforms(seed, t)`), so a sampled row draws what it draws in the token loop; a
chosen token's log-prob comes from a forward of another shape (fp32 rounding: within 1e-5, tested).
Only the eager loop jumps: the captured decode step (static.py) runs every token, one replay each.
The tokens of a reply fed so far are recorded per row (`DecodeState.fed`): a finished row's store
holds only the keys computed, so its forced tail is prefilled with the next observation.
"""

from __future__ import annotations

import torch

from agentrl.sampling.base import SamplingParams
from agentrl.sampling.constraint import advance
from agentrl.sampling.decode import DecodeState, compact, decode_step
from agentrl.sampling.kv import left_padded


def take_forced(state: DecodeState, t: torch.Tensor, T: int, stop: torch.Tensor) -> int:
    """Append every forced token at the active rows' next indices `t` [n] (advanced in place): a
    token is forced where every alive command of the row continues with it. Log-prob 0, the
    commands advanced and the stop checked as `decode_step` does. Returns how many were taken."""
    act, taken = state.act, 0
    for _ in range(T):
        at = t[act]
        room = (at < T) & ~state.done[act]
        column = state.table[act, :, at.clamp(max=T - 1)]  # [a, C]: each row's commands' tokens at its own index
        live = state.alive[act] & (column >= 0)
        hi = torch.where(live, column, -1).max(dim=1).values
        lo = torch.where(live, column, torch.iinfo(column.dtype).max).min(dim=1).values
        forced = room & live.any(dim=1) & (hi == lo)
        n = int(forced.sum())  # a host sync per pass: what a CPU pays nothing for
        if n == 0:
            return taken
        rows, token, pos = act[forced], hi[forced], at[forced]
        state.alive[rows] = advance(state.alive[rows], column[forced], token)
        state.tokens[rows, pos] = token
        state.logps[rows, pos] = 0.0
        newly = torch.isin(token, stop)
        state.length[rows] = torch.where(newly, pos + 1, state.length[rows])
        state.done[rows] |= newly
        state.last[rows] = token
        t[rows] += 1
        taken += n
    return taken


def decode_jump(sampler, state: DecodeState, params: SamplingParams, stop: torch.Tensor) -> None:
    """`HFSampler._decode`'s token loop with forced tokens jumped (module docstring): choose, take
    what is forced, then one forward of every unfinished row's new tokens; until every row stopped
    or reached max_new_tokens. `state.fed`: each row's reply tokens whose keys are stored."""
    T, store = params.max_new_tokens, sampler.store
    t = torch.zeros(len(state.order), dtype=torch.long, device=state.logits.device)  # each row's next token index
    fed = state.fed = [0] * len(state.order)
    while True:
        decode_step(state, t[state.act], params, stop)
        t[state.act] += 1
        sampler.forced_tokens += take_forced(state, t, T, stop)
        done, at = state.done.tolist(), t.tolist()
        running = [r for r in state.active if not done[r] and at[r] < T]
        if not running:
            return
        if len(running) < len(state.active):  # every row's computed keys move with it
            compact(state, running, store, max(state.prompt_len[r] + fed[r] for r in state.active))
        tokens = state.tokens[state.act].tolist()
        rows = [(state.row_slots[r], tokens[j][fed[r]:at[r]], state.prompt_len[r] + fed[r])
                for j, r in enumerate(state.active)]
        shape = (len(rows), max(len(new) for _, new, _ in rows))
        kv_len = max(state.prompt_len[r] + at[r] for r in state.active)
        sampler.decode_forwards += 1
        state.logits = sampler._forward(*left_padded(rows, shape, sampler.pad_id, state.act_slots, state.span, kv_len,
                                                     state.logits.device))
        for r in state.active:
            fed[r] = at[r]
