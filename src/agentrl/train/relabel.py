"""DAgger (`agentrl sft --relabel ROLLOUT`): the states a policy reached, labelled by the planner.

A warm start learns from walkthroughs only, the states on the expert's path; the policy's own
mistakes take it elsewhere, where nobody taught it (it wanders, or loops). DAgger (Ross et al.,
2011; how ALFWorld's BUTLER was trained) adds the policy's own states to the data, each with the
expert's command there. For every trajectory of an `agentrl rollout` output on train games
(its trajectories.jsonl), env/planner.py replays its commands and asks TextWorld's PDDL planner
(the walkthroughs' author) at up to `sft.relabel_states` states: the first where the policy
left the plan, then some spread over the rest. Each labelled state at step t becomes one
example: the exact token ids the policy saw before its reply t, then the taught reply `Action:
<planner's command>` and its end-of-turn token, masked on the reply. `agentrl sft` trains on them
with the walkthroughs of `sft.games` (the aggregated data set), from `--init-adapter` (the
policy that was rolled out) or a fresh LoRA.

The trajectories must be this model's (token ids checked as `--from` checks them), sampled with
the whole episode in context (prompt.history 0) and on training games: a held-out split's games
are refused (their labels would be the test's answers). Each trajectory's replay must give the
observations it recorded, else it is skipped (another game file or engine), counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentrl.env import EnvsOnDemand, find_games
from agentrl.env.planner import LABEL, PLANNER_DIRNAME, object_seen_at, planner_labels
from agentrl.env.replay import ReplayCache
from agentrl.errors import UserError
from agentrl.prompt import ChatRenderer, reply_text
from agentrl.train.rft import check_tokenizer, trajectory_records

HELD_OUT = ("valid_seen", "valid_unseen", "valid_train")  # evaluation and checkpoint-choice splits: never taught
NEEDED = ("task_id", "split", "reply_starts", "step_records")


@dataclass
class Relabelled:
    """The labelled states of some trajectories.jsonl files, as (example id, task type, ids, mask)."""

    sequences: list[tuple[str, str, list[int], list[int]]] = field(default_factory=list)
    trajectories: int = 0  # read
    labelled: int = 0  # trajectories with a labelled state (the others kept to the planner's plan, or were skipped)
    unseen: int = 0  # relabel_from seen: trajectories that never saw the task's object (nothing to label)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (trajectory id, why)
    files: list[dict] = field(default_factory=list)  # {"path", "sha256"}

    def summary(self) -> dict:
        return {"relabel": [d["path"] for d in self.files], "trajectories": self.trajectories, "labelled": self.labelled,
                "states": len(self.sequences), "skipped": len(self.skipped),
                **({"never_saw_the_object": self.unseen} if self.unseen else {})}


@dataclass
class _Trajectory:
    tid: str
    game: object
    task_type: str
    ids: list[int]
    reply_starts: list[int]
    commands: list[str | None]
    observations: list[str]
    start: int | None = 0  # the first step that may be labelled (None: none may)


def read_trajectories(paths: list[Path], cfg, tokenizer, out: Relabelled) -> list[_Trajectory]:
    """The trajectories of `paths`, checked (fields, split, tokenizer) and matched to their games."""
    if cfg.prompt.history:
        raise UserError("--relabel needs the whole episode in context (prompt.history 0): a state's example is the "
                        "exact context the policy replied to")
    games: dict[str, dict] = {}
    found = []
    for line, where, rec, ids, _ in trajectory_records(paths, out.files):
        if any(k not in rec for k in NEEDED):
            raise UserError(f"{where}: not a trajectory record (needs {', '.join(NEEDED)}: trajectories.jsonl "
                            "from `agentrl rollout`)")
        split = str(rec["split"])
        if split in HELD_OUT:
            raise UserError(f"{where}: a {split} trajectory: --relabel teaches the planner's commands in its "
                            "games, and held-out games are never taught (roll out on the train split)")
        if split not in games:
            games[split] = {g.game_id: g for g in find_games(cfg.env.kind, split, cfg.data.root)}
        game = games[split].get(rec["task_id"])
        if game is None:
            raise UserError(f"{where}: game {rec['task_id']} is not in the {split} split of "
                            f"{cfg.data.root or '$ALFWORLD_DATA'}: point --data at the games it was rolled out on")
        check_tokenizer(rec, ids, tokenizer, where)
        steps = rec["step_records"]
        out.trajectories += 1
        observations = [s.get("observation", "") for s in steps]
        start = (0 if cfg.sft.relabel_from == "start"
                 else object_seen_at(game, rec.get("initial_observation", ""), observations))
        found.append(_Trajectory(f"{rec['task_id']}#{rec.get('trajectory', 0)}@{len(out.files) - 1}:{line}", game,
                                 str(rec.get("task_type", "")), ids, [int(x) for x in rec["reply_starts"]],
                                 [s.get("command") for s in steps], observations, start))
    return found


def relabelled_states(paths: list[Path], cfg, tokenizer, cache_dir: Path, on_phase=None, on_done=None) -> Relabelled:
    """The planner's labels at the states the trajectories of `paths` reached, as training sequences.
    Labels come from `<cache>/planner/` or the env workers (`cfg.env`); `on_phase(name, total)`,
    `on_done(k)`: progress."""
    out = Relabelled()
    read = read_trajectories(paths, cfg, tokenizer, out)
    trajectories = [t for t in read if t.start is not None]
    out.unseen = len(read) - len(trajectories)
    if on_phase is not None:
        on_phase("planner", len(trajectories))
    envs = EnvsOnDemand(cfg)
    try:
        records = planner_labels([(t.tid, t.game, t.commands, t.start) for t in trajectories], envs,
                                 ReplayCache(cache_dir / PLANNER_DIRNAME), cfg.sft.relabel_states, on_done)
    finally:
        envs.shutdown()
    end_of_turn = ChatRenderer(tokenizer).end_of_turn_ids
    for t in trajectories:
        r = records[t.tid]
        if r.error is not None:
            out.skipped.append((t.tid, f"the planner's replay failed: {r.error}"))
            continue
        if [s["observation"] for s in r.steps] != t.observations[: len(r.steps)]:
            out.skipped.append((t.tid, "the engine answers its commands otherwise than it recorded (another game file or engine)"))
            continue
        labelled = [(i, s[LABEL]) for i, s in enumerate(r.steps) if s.get(LABEL)]
        out.labelled += bool(labelled)
        for i, command in labelled:
            if i >= len(t.reply_starts):
                continue
            reply = list(tokenizer(reply_text(command, "action"), add_special_tokens=False).input_ids) + end_of_turn
            context = t.ids[: t.reply_starts[i]]
            out.sequences.append((f"{t.tid}/{i}", t.task_type, context + reply, [0] * len(context) + [1] * len(reply)))
    return out
