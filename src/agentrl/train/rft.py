"""Rejection-sampling fine-tuning (`agentrl sft --from ROLLOUT`): behaviour cloning on the won
rollouts of `agentrl rollout` (its trajectories.jsonl), by their exact token ids.

Each won trajectory becomes one example (under prompt.history N: one per reply, its window then
the reply, as the learner cuts it), masked on what the policy generated; `agentrl sft` then trains
on them as on walkthroughs. Iterated: roll out with the new adapter, keep the wins, again.
The records carry token ids, not text: they must come from this model's tokenizer, which is
checked (every id within its vocabulary, every won reply's ids decode to the reply's recorded text).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from agentrl.errors import UserError
from agentrl.io import read_jsonl_numbered
from agentrl.rollout.trajectory import step_sequences
from agentrl.train.sft_plan import rollout_file

NEEDED = ("task_id", "won", "token_ids", "action_mask")


@dataclass
class WonRollouts:
    """The won trajectories of some trajectories.jsonl files, as (example id, task type, ids, mask)."""

    sequences: list[tuple[str, str, list[int], list[int]]] = field(default_factory=list)
    trajectories: int = 0  # read, won or not
    won: int = 0
    files: list[dict] = field(default_factory=list)  # {"path", "sha256"}: what the adapter was made from


def _record(rec, where: str) -> tuple[list[int], list[int]]:
    if not isinstance(rec, dict) or any(k not in rec for k in NEEDED):
        raise UserError(f"{where}: not a trajectory record (needs {', '.join(NEEDED)}: trajectories.jsonl from `agentrl rollout`)")
    ids, mask = rec["token_ids"], rec["action_mask"]
    if not (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)):
        raise UserError(f"{where}: token_ids and action_mask must be lists of one length")
    return [int(x) for x in ids], [1 if int(m) else 0 for m in mask]


def check_tokenizer(rec: dict, ids: list[int], tokenizer, where: str) -> None:
    """The ids are this tokenizer's: within its vocabulary, and each reply decodes to its recorded text."""
    if ids and (max(ids) >= len(tokenizer) or min(ids) < 0):
        raise UserError(f"{where}: token id {max(ids)} is outside this model's tokenizer ({len(tokenizer)} ids): "
                        "the trajectories were sampled with another tokenizer")
    for start, n, step in zip(rec.get("reply_starts") or [], rec.get("step_tokens") or [], rec.get("step_records") or []):
        text = tokenizer.decode(ids[start : start + n], skip_special_tokens=True)
        if isinstance(step, dict) and isinstance(step.get("response"), str) and text.strip() != step["response"].strip():
            raise UserError(f"{where}: a reply's token ids decode to {text.strip()[:40]!r}, not its recorded "
                            f"{step['response'].strip()[:40]!r}: the trajectories were sampled with another tokenizer")


def trajectory_records(paths, files: list[dict]):
    """Each record of `paths` (trajectories.jsonl files or rollout directories) as (its line, where
    it is, the record, its token ids, its action mask); each file goes into `files` ({"path",
    "sha256"}: what an adapter was made from) as it is opened."""
    for path in paths:
        f = rollout_file(path)
        files.append({"path": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()})
        for line, rec in read_jsonl_numbered(f, bad="not a JSON line (expected trajectories.jsonl from `agentrl rollout`)"):
            where = f"{f}:{line}"
            yield line, where, rec, *_record(rec, where)


def won_rollouts(paths, tokenizer, history: int = 0) -> WonRollouts:
    """The won trajectories of `paths` (files or rollout directories) as training sequences."""
    out = WonRollouts()
    for line, where, rec, ids, mask in trajectory_records(paths, out.files):
        out.trajectories += 1
        if rec["won"] is not True:
            continue
        check_tokenizer(rec, ids, tokenizer, where)
        out.won += 1
        view = _View(ids, mask, [int(x) for x in rec.get("reply_starts") or []], [int(x) for x in rec.get("step_tokens") or []])
        example_id = f"{rec['task_id']}#{rec.get('trajectory', 0)}@{len(out.files) - 1}:{line}"
        out.sequences += [(example_id, str(rec.get("task_type", "")), s_ids, s_mask)
                          for s_ids, s_mask, _ in step_sequences(view, history) if sum(s_mask)]
    if not out.won:
        raise UserError(f"--from: no won trajectory in {', '.join(d['path'] for d in out.files)} "
                        f"({out.trajectories} trajectories): nothing to clone")
    return out


@dataclass
class _View:
    """What step_sequences reads of a trajectory."""

    token_ids: list[int]
    action_mask: list[int]
    reply_starts: list[int]
    step_tokens: list[int]

    @property
    def logprobs(self) -> list[float]:
        return [0.0] * len(self.token_ids)
