"""Constrained decoding over a set of commands: a row may only produce one of its commands' token
sequences (issue 48's admissible action space).

The policy. At reply position t a row may produce the t-th token of every command whose first t
tokens equal what it produced so far (the commands still *alive*); the policy there is the model's
softmax renormalised over those tokens (sampled at the sampling temperature, its log-prob recorded at
temperature 1, as every log-prob of the Sampler contract). Every command ends with a stop token, so
a reply ends exactly where its command ends, and no command is a prefix of another. A position with
one alive token is *forced*: its log-prob is exactly 0 (it carries no gradient, and it stays an
action token: token-mean denominators count it, as they count every generated token).

On the device a batch carries, per row, a padded table of its commands' ids [C, T] (-1 past a
command's end) and an alive mask [C]: the allowed tokens at position t are the t-th column of the
alive commands. `constrain` and `advance` are tensor work only (no host sync, no tensor built from
host data), so the same code runs in the eager token loop and inside a captured CUDA graph. A row
with no alive command is unconstrained (an unconstrained row in a mixed batch, a padding row, a row
past its stop token).

The learner rebuilds the same masks from what the rollout stores per action token
(`CommandSet.allowed_along`): the ids allowed where that token was produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommandSet:
    """`GenRequest.constraint`: the token sequences a row may produce, each ending with a stop token.
    `names`: what each sequence stands for (the admissible command), in the same order."""

    commands: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.commands or any(len(c) == 0 for c in self.commands):
            raise ValueError("a CommandSet needs at least one command, each at least one token long")
        if self.names and len(self.names) != len(self.commands):
            raise ValueError(f"{len(self.names)} names for {len(self.commands)} commands")

    @classmethod
    def of(cls, named: dict[str, Sequence[int]]) -> "CommandSet":
        """From {command: its token ids}; a sequence listed twice (two names, one reply) is kept once."""
        seen: dict[tuple[int, ...], str] = {}
        for name, ids in named.items():
            seen.setdefault(tuple(int(i) for i in ids), name)
        return cls(tuple(seen), tuple(seen.values()))

    def check_stops(self, stop_ids: set[int]) -> None:
        """Every command must end with a stop token (else a reply would run on past its command), and
        none may contain one before its end (the reply would stop inside it)."""
        for c in self.commands:
            if c[-1] not in stop_ids or any(i in stop_ids for i in c[:-1]):
                raise ValueError(f"constraint command {list(c)} must end with a stop token ({sorted(stop_ids)}) "
                                 "and contain none before its end")

    def allowed_along(self, ids: Sequence[int]) -> list[list[int]]:
        """For each token of a reply `ids` (what the row produced), the sorted ids allowed where it was
        produced; [] past the point where no command is alive (a reply cut, or not of this set)."""
        alive = list(self.commands)
        out: list[list[int]] = []
        for t, token in enumerate(ids):
            allowed = sorted({c[t] for c in alive if len(c) > t})
            out.append(allowed)
            alive = [c for c in alive if len(c) > t and c[t] == token]
        return out

    def match(self, ids: Sequence[int]) -> str | None:
        """The name of the command the reply `ids` is, None when it is none of them (cut short)."""
        try:
            return self.names[self.commands.index(tuple(ids))] if self.names else None
        except ValueError:
            return None

    def table(self, width: int) -> torch.Tensor:
        """[C, width] int64 on the host: each command's ids, -1 past its end (a command longer than
        `width` is cut: a reply of max_new_tokens ends before it does)."""
        out = torch.full((len(self.commands), width), -1, dtype=torch.long)
        for i, c in enumerate(self.commands):
            n = min(len(c), width)
            out[i, :n] = torch.tensor(c[:n], dtype=torch.long)
        return out


def batch_tables(constraints: Sequence[CommandSet | None], width: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of a batch, its table and alive mask: ([n, C, width] ids, -1 padded; [n, C] bool), C the
    most commands of any row; an unconstrained row has no alive command. None when no row is constrained."""
    if all(c is None for c in constraints):
        return None
    C = max(len(c.commands) for c in constraints if c is not None)
    table = torch.full((len(constraints), C, width), -1, dtype=torch.long)
    alive = torch.zeros((len(constraints), C), dtype=torch.bool)
    for r, c in enumerate(constraints):
        if c is not None:
            table[r, : len(c.commands)] = c.table(width)
            alive[r, : len(c.commands)] = True
    return table.to(device), alive.to(device)


def column_at(table: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """[n, C]: every command's token at position t of a table [n, C, T] (`t` an int or a device scalar [1])."""
    if isinstance(t, int):
        return table[:, :, t]
    return table.index_select(2, t.reshape(1)).squeeze(2)


def constrain(logits: torch.Tensor, column: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """`logits` [n, V] with every token that no alive command continues with (`column` [n, C]: the
    commands' tokens at this position) set to -inf; rows with no alive command untouched. Device work only."""
    n, V = logits.shape
    live = alive & (column >= 0)
    index = torch.where(live, column, torch.full_like(column, V))  # dead entries land in a spare column
    allowed = torch.zeros((n, V + 1), dtype=torch.bool, device=logits.device)
    allowed.scatter_(1, index, True)
    allowed = allowed[:, :V] | ~live.any(dim=1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))


def advance(alive: torch.Tensor, column: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The commands still alive after each row produced `chosen` [n] where `column` [n, C] was read."""
    return alive & (column == chosen[:, None])
