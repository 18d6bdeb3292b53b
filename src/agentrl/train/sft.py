"""`agentrl sft`: the warm start. Behaviour cloning on the games' expert walkthroughs.

A small model wins no ALFWorld game from the prompt alone, so every GRPO group is all-fail and
nothing is learnt. The field's answer (ETO, Trinity-RFT, "Few-Shot Butlers") is a supervised
warm start on expert trajectories, then RL. Here:

    examples = expert_dataset(games)     # replay each walkthrough through the env and the SAME
                                         # ModelPolicy/renderer a rollout uses: exact token ids,
                                         # mask = 1 on each reply and its end-of-turn token
    for epoch: for step: AdamW on the masked NLL (token mean), run packed by the learner's token budget
    heldout NLL on valid_seen walkthroughs after each epoch
    write DIR: a PEFT adapter (the learner's rank and target modules; learner.lora_r 0: every
               weight, a model directory), agentrl.json (the prompt it was taught with),
               sft_metrics.jsonl; atomically

Walkthroughs carry no thoughts, so the reply taught is `Action: <command>` (prompt.reply
"action", system_action.txt) and the in-context example is left out (prompt.example "none"):
the dataset is what the policy will see at rollout time, token for token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrl import faults, procmem
from agentrl.config import ADAPTER_RECORD, Config, effective_prompt
from agentrl.env import EnvsOnDemand, env_factory, prompt_options
from agentrl.env.data import round_robin  # noqa: F401 (tests import it from here)
from agentrl.env.decoy import DECOY_DIRNAME, DecoyStats, decoy_games
from agentrl.env.expert import EXPERT_DIRNAME, expert_games
from agentrl.env.pool import LocalEnvs
from agentrl.env.replay import REPLAY_DIRNAME, ReplayCache, ReplayStats, recorded_envs, replay_walkthroughs
from agentrl.errors import UserError
from agentrl.io import atomic_path, atomic_write_jsonl, read_jsonl
from agentrl.machine import machine
from agentrl.models import cache_root, load_model
from agentrl.prompt import SYSTEM_FILES, ChatRenderer, default_prompt_dir, reply_text
from agentrl.rollout import ModelPolicy, run_lockstep
from agentrl.rollout.trajectory import step_sequences
from agentrl.sampling.base import Completion, SamplingParams
from agentrl.train import checkpoint
from agentrl.train.bc import masked_nll_sum  # noqa: F401 (sft's loss; tests import it from here)
from agentrl.train.learner import LocalLearner, build_learner
from agentrl.train.relabel import relabelled_states
from agentrl.train.rft import won_rollouts
from agentrl.train.sft_plan import (DATASET_VERSION, NOT_RECIPE, check_init_adapter, check_out_dir, comparable,  # noqa: F401 (the light half:
                                     first_difference, partial_dir, recipe, relabel_digests, reusable,  # tests and
                                     select_games, sft_prompt, source_digests)  # benchmarks import them from here too)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the expert data
class ExpertSampler:
    """The Sampler protocol answered by the walkthrough: row `key = (game_id, index)` gets the
    next expert command of its game as the taught reply, tokenised the way a sampler returns a
    reply (its ids, then the end-of-turn token). Driving the ordinary ModelPolicy with it makes
    the recorded ids exactly those of a rollout that took the same actions.

    `reply` None: the walkthroughs are whole replies, taken verbatim, and may be keyed by the
    whole key (game, index): replaying an eval's recorded episodes (benchmarks/bench_context.py)."""

    def __init__(self, tokenizer, walkthroughs: dict, reply: str | None):
        self.tokenizer, self.walkthroughs, self.reply = tokenizer, walkthroughs, reply
        self.end_of_turn = ChatRenderer(tokenizer).end_of_turn_ids
        self.adapter_version = None
        self._steps: dict = {}

    model = None  # no torch model: the replies are read from the walkthroughs

    def generate(self, requests, params: SamplingParams) -> list[Completion]:
        out = []
        for prompt, key in ((r.prompt_ids, r.key) for r in requests):
            step = self._steps.get(key, 0)
            self._steps[key] = step + 1
            walkthrough = self.walkthroughs[key] if key in self.walkthroughs else self.walkthroughs[key[0]]
            if step >= len(walkthrough):  # the walkthrough is over and the game not won: an empty no-op
                out.append(Completion(list(prompt), [], [], "", "stop"))
                continue
            text = walkthrough[step] if self.reply is None else reply_text(walkthrough[step], self.reply)
            ids = list(self.tokenizer(text, add_special_tokens=False).input_ids) + self.end_of_turn
            out.append(Completion(list(prompt), ids, [0.0] * len(ids), text, "stop" if self.end_of_turn else "length"))
        return out

    def load(self, weights) -> None:  # pragma: no cover - the protocol's; never called
        raise NotImplementedError

    def sleep(self) -> None:
        """Nothing to give back."""

    def rows_that_fit(self, tokens_per_row: int) -> None:
        return None  # no KV cache

    def reserve(self, rows: int, tokens_per_row: int) -> None:
        """No KV cache."""

    def close(self) -> None:
        """Nothing held."""

    def release(self, keys) -> None:
        """Nothing kept per trajectory: the replies are read from the walkthroughs."""


@dataclass
class Example:
    game_id: str
    task_type: str
    token_ids: list[int]
    action_mask: list[int]

    @property
    def reply_tokens(self) -> int:
        return sum(self.action_mask)


@dataclass
class ExpertData:
    examples: list[Example]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (game id, why)
    cached: bool = False
    replay: ReplayStats | None = None  # None: the examples came from the dataset cache
    decoys: DecoyStats | None = None  # sft.decoys: the games given decoy visits


def dataset_key(games, cfg: Config, tokenizer) -> str:
    """Changes with the games (and their walkthroughs), the prompt text and variant, the tokenizer."""
    prompt_dir = Path(cfg.prompt.dir) if cfg.prompt.dir else default_prompt_dir()
    h = hashlib.sha256()
    h.update(json.dumps([DATASET_VERSION, cfg.env.kind, cfg.prompt.example, cfg.prompt.reply,
                         [(g.game_id, g.split, list(g.walkthrough)) for g in games]]).encode())
    if any(g.untaught for g in games):  # (only then: the caches built before decoys keep their keys)
        h.update(json.dumps([list(g.untaught) for g in games]).encode())
    if cfg.prompt.admissible:  # (only when on: the caches built before the option keep their keys)
        h.update(b"admissible")
    if cfg.prompt.history:
        h.update(f"history {cfg.prompt.history}".encode())
    files = [prompt_dir / SYSTEM_FILES[cfg.prompt.reply or "react"]]
    if cfg.prompt.example == "type":
        files += sorted((prompt_dir / "examples").glob("*.txt"))
    for f in files:
        h.update(f.read_bytes() if f.is_file() else b"")
    h.update(json.dumps([tokenizer.name_or_path, len(tokenizer), tokenizer.chat_template or ""]).encode())
    return h.hexdigest()[:20]


def expert_dataset(cfg: Config, games, tokenizer, envs=None, cache_dir: Path | None = None, on_step=None,
                   replays: ReplayCache | None = None, on_game=None) -> ExpertData:
    """Replay each game's walkthrough with the prompt `cfg.prompt` asks for. A walkthrough that
    does not win its game is reported and skipped. With `cache_dir` the examples are kept there,
    keyed by games, prompt and tokenizer.

    Two steps: the walkthroughs go through the engine on `envs`' workers (None: in this process),
    or come from the `replays` cache (replay.py: the env's answers, keyed by game file); then one
    trajectory per game, all in lockstep, replays those answers through the rollout's own policy
    and renderer, in this process (`on_step`), which makes the token ids."""
    cache = cache_dir / f"{dataset_key(games, cfg, tokenizer)}.jsonl" if cache_dir else None
    if cache is not None and cache.is_file():
        rows = read_jsonl(cache)
        return ExpertData([Example(**r) for r in rows if "token_ids" in r],
                          [(r["game_id"], r["skipped"]) for r in rows if "skipped" in r], cached=True)
    no_walkthrough = [g for g in games if not g.walkthrough]
    games = [g for g in games if g.walkthrough]
    backend = envs if envs is not None else LocalEnvs(env_factory(cfg.env.kind))
    records, stats = replay_walkthroughs(games, backend, replays, cfg.env.fuzzy_threshold, on_game)
    rollout = expert_rollout(cfg, games, tokenizer, records, on_step) if games else None
    examples, skipped = [], [(g.game_id, "no walkthrough") for g in no_walkthrough]
    for t in rollout.trajectories if rollout else []:
        if t.won:  # prompt.history N: one example per step, its window then the reply (what a rollout samples from)
            examples += [Example(t.game.game_id, t.game.task_type, ids, mask)
                         for ids, mask in taught_sequences(t, cfg.prompt.history or 0)]
        else:
            why = t.error or f"the walkthrough did not win the game (ended {t.stop_reason} after {len(t.steps)} steps)"
            skipped.append((t.game.game_id, why))
    env_failed = stats.failed or any(t.stop_reason == "env_error" for t in (rollout.trajectories if rollout else []))
    if cache is not None and not env_failed:  # an env failure may pass: do not remember it
        atomic_write_jsonl(cache, [e.__dict__ for e in examples] + [{"game_id": g, "skipped": w} for g, w in skipped])
    return ExpertData(examples, skipped, replay=stats)


def taught_sequences(t, history: int) -> list[tuple[list[int], list[int]]]:
    """A won walkthrough's (ids, action mask) as `step_sequences` gives them, less the replies of
    its untaught steps (a decoy visit's `go to`, env/decoy.py): off the mask in the whole episode,
    left out under prompt.history N. What follows them is taught."""
    skip = set(t.game.untaught)
    seqs = step_sequences(t, history)
    if not skip:
        return [(ids, mask) for ids, mask, _ in seqs]
    if history:
        return [(ids, mask) for i, (ids, mask, _) in enumerate(seqs) if i not in skip]
    ids, mask, _ = seqs[0]
    for i in skip:
        start = t.reply_starts[i]
        mask[start:start + t.step_tokens[i]] = [0] * t.step_tokens[i]
    return [(ids, mask)]


def expert_rollout(cfg: Config, games, tokenizer, records: dict, on_step=None):
    """The walkthroughs' trajectories: the ordinary ModelPolicy driven by ExpertSampler, its
    commands answered from the replay records (the same answers the engine gave, no engine)."""
    sampler = ExpertSampler(tokenizer, {g.game_id: tuple(g.walkthrough) for g in games}, cfg.prompt.reply or "react")
    longest = max(len(g.walkthrough) for g in games)
    policy = ModelPolicy(sampler, SamplingParams(0.0, 1.0, 10_000), seed=0, **prompt_options(cfg))
    return run_lockstep(games, policy, max_steps=longest + 1, fuzzy_threshold=cfg.env.fuzzy_threshold,
                        make_env=recorded_envs(records), on_step=on_step)


# ---------------------------------------------------------------- batching and the loss
def micro_batches(examples: list[Example], token_budget: int) -> list[list[Example]]:
    """Examples sorted by length and bucketed so that rows x longest row <= token_budget (a longer
    example gets a bucket of its own): the recipe's unit, `sft.token_budget`; buckets make up the
    optimizer steps. How a step's examples are run (packed, by the learner's token budget) does
    not change its gradient."""
    out: list[list[Example]] = []
    for e in sorted(examples, key=lambda e: len(e.token_ids)):
        if out and (len(out[-1]) + 1) * len(e.token_ids) <= token_budget:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def example_micro_batches(learner: LocalLearner, examples: list[Example]) -> list[list[list[int]]]:
    """`examples` as the learner runs them: micro-batches of rows of indices (its token budget, packed)."""
    return learner.micro_batches([len(e.token_ids) for e in examples])


@torch.no_grad()
def heldout_nll(learner: LocalLearner, examples: list[Example]) -> float | None:
    """Mean NLL per reply token over `examples` (None: none)."""
    if not examples:
        return None
    learner.model.eval()
    sequences = [e.token_ids for e in examples]
    total, n = 0.0, 0
    for rows in example_micro_batches(learner, examples):
        masks = [examples[i].action_mask for row in rows for i in row]
        with learner.autocast():
            s, k = masked_nll_sum(learner.model, learner.inputs(sequences, rows, masks=masks), masks)
        total, n = total + float(s), n + k
    return total / max(n, 1)


# ---------------------------------------------------------------- the run
@dataclass
class SftHooks:
    """Progress callbacks (the CLI draws them with rich)."""

    phase: callable = lambda name, total=None: None  # "replay" | "heldout" | "train"
    advance: callable = lambda n=1, **info: None
    done: callable = lambda row: None
    note: callable = lambda text: None  # a line to show (a resumed run says where it continues)


# ---------------------------------------------------------------- checkpoints: a killed warm start continues
@dataclass
class SftState:
    """Where a warm start stands at a checkpoint (the learner's weights, optimizer and RNG lie beside
    it). The batch order is not stored: it is drawn again from the seed, the same."""

    step: int  # optimizer steps done, over all epochs
    total_steps: int
    epoch: int  # the epoch in progress (1-based)
    epoch_step: int  # its optimizer steps done
    epoch_sum: float  # its train NLL sum and reply tokens so far
    epoch_n: int
    rows: list  # the epoch rows so far (the first: the fresh LoRA's held-out NLL)
    scheduler: dict  # the lr schedule's state_dict
    train_s: float  # seconds of training, over every process that ran it
    elapsed_s: float  # seconds of the whole command, the same
    recipe: dict
    dataset: str  # digest of the examples (token ids and masks): the same data, or no resume
    resumes: list = field(default_factory=list)  # the steps it was resumed at
    adapter_version: int = 0  # (checkpoint.load reads it)


def unfinished(out: Path) -> Path | None:
    """The latest checkpoint of OUT's unfinished warm start (None: there is none)."""
    partial = partial_dir(out)
    if not (partial / "checkpoints").is_dir():
        return None
    checkpoint.clean_partial(partial)  # a temporary a kill left behind
    return checkpoint.latest(partial)


def resumable(cfg: Config, out: Path, force: bool, resume: bool, sources: list[Path] | None = None,
              relabel: list[Path] | None = None) -> Path | None:
    """The checkpoint this run continues: OUT's unfinished warm start of this very recipe, unless
    `resume` is off (then it is discarded). One of another recipe is discarded with `force`, else
    refused: it is the user's, and this run would not continue it."""
    found = unfinished(out)
    if found is None:
        return None
    state = checkpoint.read_state(found, SftState)
    differs = first_difference(comparable(state.recipe),
                               recipe(sft_prompt(cfg), source_digests(sources), relabel_digests(relabel)))
    if resume and differs is None:
        return found
    if differs is not None and not force and resume:
        raise UserError(f"{partial_dir(out)} holds an unfinished warm start of another recipe ({differs}), at "
                        f"step {state.step} of {state.total_steps}; continue it with its own settings, or discard "
                        "it with --force or --no-resume")
    shutil.rmtree(partial_dir(out))
    return None


def dataset_digest(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.game_id, e.token_ids, e.action_mask]).encode())
    return h.hexdigest()[:20]


def run_sft(cfg: Config, out: Path, force: bool = False, hooks: SftHooks | None = None, model=None, tokenizer=None,
            cache_dir: Path | None = None, sources: list[Path] | None = None, resume: bool = True,
            relabel: list[Path] | None = None) -> dict:
    """Build the expert data, train the LoRA, write DIR. Returns the summary written to agentrl.json.
    `sources` (`--from`): rollouts' trajectories.jsonl files (or their directories): their won
    trajectories are the data in place of the walkthroughs (rejection-sampling fine-tuning).
    `relabel` (`--relabel`, DAgger): rollouts whose states the planner labels (relabel.py), added
    to the walkthroughs; `sft.init_adapter`: begin from that adapter, not a fresh LoRA.
    Checkpoints go to OUT.partial/ every `sft.checkpoint_minutes`; the same call continues from
    the latest (`resume`), and OUT.partial/ goes once DIR is written."""
    hooks = hooks or SftHooks()
    cfg = sft_prompt(cfg)
    s = cfg.sft
    check_out_dir(out, force)
    check_init_adapter(cfg)
    found = resumable(cfg, out, force, resume, sources, relabel)  # before anything loads: a refusal is one line
    if sources:  # --from: the wins, and sft.from_walkthroughs walkthroughs beside them (none by default)
        games = select_games(cfg, s.split, s.from_walkthroughs) if s.from_walkthroughs else []
    else:
        games = select_games(cfg, s.split, s.games)
    heldout_games = select_games(cfg, s.heldout_split, s.heldout_games) if s.heldout_games else []
    t0 = time.perf_counter()
    if model is None or tokenizer is None:
        dtype = cfg.model.dtype if cfg.learner.lora_r else "float32"  # full fine-tuning: fp32 master weights
        model, tokenizer = load_model(cfg.model.name, dtype, cfg.model.device, cfg.model.trust_remote_code)
    won = won_rollouts(sources, tokenizer, cfg.prompt.history or 0) if sources else None  # before any replay: errors first
    data, held = replay(cfg, games, heldout_games, tokenizer, cache_dir, hooks)
    if won is not None:
        data.examples = [Example(*seq) for seq in won.sequences] + data.examples
    dagger = relabelled(cfg, relabel, tokenizer, cache_dir, hooks) if relabel else None
    if dagger is not None:  # the aggregated data set: the walkthroughs and the policy's labelled states
        data.examples += [Example(*seq) for seq in dagger.sequences]
    replay_s = time.perf_counter() - t0
    learner = sft_learner(cfg, model)
    digest = dataset_digest(data.examples)
    run_recipe = recipe(cfg, won.files if won is not None else None, [d["sha256"] for d in dagger.files] if dagger else None)
    resumed = None
    if found is not None:
        resumed, _ = checkpoint.load(found, learner, SftState)
        if resumed.dataset != digest:
            raise UserError(f"the expert data changed since {partial_dir(out)} was written (games, walkthroughs or "
                            "prompt files): it cannot be continued; discard it with --no-resume")
        resumed.resumes.append(resumed.step)
        hooks.note(f"continuing {partial_dir(out)} at step {resumed.step} of {resumed.total_steps} "
                   f"(epoch {resumed.epoch})")
    before = resumed.elapsed_s if resumed else 0.0

    def keep(**progress) -> None:
        state = SftState(**progress, elapsed_s=before + time.perf_counter() - t0, recipe=run_recipe, dataset=digest,
                         resumes=resumed.resumes if resumed else [])
        checkpoint.save(partial_dir(out), state, learner, name=f"step{state.step:06d}",
                        resume=f"agentrl sft ... --out {out}")  # (the same command)

    origin = ({"from": won.files, "trajectories": won.trajectories, "won": won.won,
               **({"walkthroughs": len(games)} if games else {})} if won is not None
              else {"split": s.split, "games": len(games)})
    if dagger is not None:
        origin["dagger"] = dagger.summary()
    if data.decoys is not None:
        origin["decoys"] = data.decoys.summary()
    if s.init_adapter:
        origin["init_adapter"] = s.init_adapter
    rows = [{"kind": "dataset", **origin, "examples": len(data.examples), "skipped": len(data.skipped),
             "reply_tokens": sum(e.reply_tokens for e in data.examples),
             "tokens": sum(len(e.token_ids) for e in data.examples), "heldout_examples": len(held.examples),
             "cached": data.cached, "replay_s": round(replay_s, 3), "prompt": effective_prompt(cfg),
             **({"replay_hits": data.replay.hits, "replayed": data.replay.replayed} if data.replay else {})}]
    rows += train_epochs(cfg, learner, data.examples, held.examples, hooks, replay_s, keep, resumed)
    summary = {
        "prompt": effective_prompt(cfg),
        "base_model": cfg.model.name,
        "lora": {"r": cfg.learner.lora_r, "alpha": cfg.learner.lora_alpha, "target_modules": list(cfg.learner.target_modules)},
        "weights": learner.kind,  # lora, or full (learner.lora_r 0: every weight, a model directory)
        "sft": {**origin, "examples": len(data.examples), "skipped": len(data.skipped), "epochs": s.epochs, "lr": s.lr,
                "optimizer_steps": sum(r.get("steps", 0) for r in rows), "schedule": s.schedule, "warmup": s.warmup,
                "reply_tokens": rows[0]["reply_tokens"], "seed": cfg.seed,
                **({"expert": s.expert} if s.expert != "walkthrough" and won is None else {})},
        "heldout_nll": {"before": rows[1]["heldout_nll"], "after": rows[-1]["heldout_nll"]},
        "minutes": round((before + time.perf_counter() - t0) / 60, 2),
        "allocator": procmem.allocator(),  # what the minutes ran on (procmem.py: glibc's heap slows a long run)
        "machine": machine(cfg),  # the dtype it ran at and where (its bytes differ on another CPU)
        "recipe": run_recipe,
    }
    if resumed is not None:
        summary["sft"]["resumed_at_steps"] = resumed.resumes
    write_adapter(learner, out, summary, rows, force)
    shutil.rmtree(partial_dir(out), ignore_errors=True)  # DIR is whole: its checkpoints are no longer needed
    return summary


SKIP_WARNINGS = 10  # games named one by one; past that, one line counts the rest by reason


def warn_skipped(skipped: list[tuple[str, str]], what: str = "walkthrough of", things: str = "games") -> None:
    """Name the first skipped games with their reasons, then count them all by reason in one line
    (the hand-coded expert on every train game skips hundreds: a line each buries the run's log)."""
    for game_id, why in skipped[:SKIP_WARNINGS]:
        log.warning("%s %s skipped: %s", what, game_id, why)
    if len(skipped) > SKIP_WARNINGS:
        reasons = Counter(why.split(" (")[0] for _, why in skipped)
        log.warning("%d %s skipped in all (%d more than named above): %s", len(skipped), things, len(skipped) - SKIP_WARNINGS,
                    "; ".join(f"{n} {why}" for why, n in reasons.most_common()))


def replay(cfg: Config, games, heldout_games, tokenizer, cache_dir: Path | None, hooks: SftHooks) -> tuple[ExpertData, ExpertData]:
    """The expert data to learn from and the held-out one (the walkthroughs replayed, or the cache).
    The replay records live beside the dataset cache (`<cache>/replay/`, see env/replay.py)."""
    cache_dir = cache_dir if cache_dir is not None else cache_root() / "sft-data"
    replays = ReplayCache(cache_dir.parent / REPLAY_DIRNAME)
    envs = EnvsOnDemand(cfg)  # no worker started when every walkthrough is in the replay cache
    try:
        games, not_taught = taught(cfg, "expert", games, envs, cache_dir, replays, hooks)
        decoys = None
        if cfg.sft.decoys and games:  # the train games only: the held-out NLL stays on the walkthroughs as walked
            hooks.phase("decoys", len(games))
            games, no_decoys, decoys = decoy_games(games, envs, ReplayCache(cache_dir.parent / DECOY_DIRNAME), replays,
                                                   cfg.sft.decoys, cfg.seed, cfg.env.fuzzy_threshold,
                                                   on_game=lambda n: hooks.advance(n))
            not_taught += no_decoys
        heldout_games, held_not_taught = taught(cfg, "heldout expert", heldout_games, envs, cache_dir, replays, hooks)
        data = expert_data(cfg, "replay", games, tokenizer, envs, cache_dir, replays, hooks)
        data.decoys = decoys
        held = expert_data(cfg, "heldout", heldout_games, tokenizer, envs, cache_dir, replays, hooks)
    finally:
        envs.shutdown()
    data.skipped += not_taught
    held.skipped += held_not_taught
    warn_skipped(data.skipped + held.skipped)
    for name, d in (("train", data), ("held-out", held)):
        if d.replay is not None:
            r = d.replay
            log.info("%s walkthroughs: %d from the replay cache, %d replayed in %.1fs; %d won, %d unwinnable, %d failed",
                     name, r.hits, r.replayed, r.seconds, r.won, r.unwinnable, r.failed)
    if games and not data.examples:  # (no games: `--from`'s rollouts are the data)
        raise UserError(f"none of the {len(games)} selected walkthroughs could be replayed to a win; nothing to learn")
    return data, held


def taught(cfg: Config, phase: str, games, envs, cache_dir: Path, replays: ReplayCache,
           hooks: SftHooks) -> tuple[list, list[tuple[str, str]]]:
    """The games as `sft.expert` teaches them, and those it cannot (game id, why): the walkthrough
    as it is; the hand-coded expert (env/expert.py) in its place, each game's play kept in
    `<cache>/expert/` and handed to the replay cache, so the replay that follows reads it."""
    if cfg.sft.expert == "walkthrough" or not games:
        return games, []
    hooks.phase(phase, len(games))
    return expert_games(games, envs, ReplayCache(cache_dir.parent / EXPERT_DIRNAME), replays, cfg.sft.expert_max_steps,
                        cfg.seed, cfg.env.fuzzy_threshold, on_game=lambda n: hooks.advance(n))


def expert_data(cfg: Config, phase: str, games, tokenizer, envs, cache_dir: Path, replays: ReplayCache,
                hooks: SftHooks) -> ExpertData:
    """One phase's expert data, its progress shown: the walkthroughs (a game at a time), then the
    examples built from them (a step at a time)."""
    if not games:
        return ExpertData([])
    hooks.phase(phase, len(games))
    return expert_dataset(cfg, games, tokenizer, envs, cache_dir, on_step=lambda step, trajs: hooks.advance(0),
                          replays=replays, on_game=lambda n: hooks.advance(n))


def sft_learner(cfg: Config, model) -> LocalLearner:
    """The learner behaviour cloning trains through: the run's LoRA (rank, target modules, weight
    decay), freshly initialised from cfg.seed (GRPO then continues it) or `sft.init_adapter`'s,
    AdamW at sft.lr, clipped at sft.grad_clip. No KL reference and no activation checkpointing:
    sft never used them."""
    settings = dataclasses.replace(cfg.learner, lr=cfg.sft.lr, grad_clip=cfg.sft.grad_clip, kl_coef=0.0,
                                   replay_coef=0.0, gradient_checkpointing=False)
    init = cfg.sft.init_adapter
    return build_learner(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_adapter=init)), model,
                         settings=settings, warm_start=bool(init))


def relabelled(cfg: Config, relabel: list[Path], tokenizer, cache_dir: Path | None, hooks: SftHooks):
    """DAgger's examples: the states of `relabel`'s trajectories, labelled by the planner (relabel.py)."""
    cache_dir = cache_dir if cache_dir is not None else cache_root() / "sft-data"
    dagger = relabelled_states(relabel, cfg, tokenizer, cache_dir.parent, on_phase=hooks.phase, on_done=hooks.advance)
    warn_skipped(dagger.skipped, "trajectory", "trajectories")
    log.info("relabelled %d states of %d trajectories (%d kept to the planner's plan; %d skipped)", len(dagger.sequences),
             dagger.trajectories, dagger.trajectories - dagger.unseen - dagger.labelled - len(dagger.skipped), len(dagger.skipped))
    if not dagger.sequences:
        raise UserError(f"--relabel: no state of the {dagger.trajectories} trajectories was labelled (each kept to the "
                        "planner's plan, or was skipped): nothing to add")
    return dagger


def nll_loss(learner: LocalLearner, examples: list[Example], n_tokens: int):
    """The loss of one optimizer step on `examples`: the token-mean NLL over its `n_tokens` reply
    tokens, one micro-batch (rows of indices into `examples`) at a time; each hands back its NLL
    sum (the epoch's train NLL)."""
    sequences = [e.token_ids for e in examples]

    def loss_fn(model, rows: list[list[int]]):
        masks = [examples[i].action_mask for row in rows for i in row]
        loss_sum, _ = masked_nll_sum(model, learner.inputs(sequences, rows, masks=masks), masks)
        return loss_sum / n_tokens, float(loss_sum.detach())

    return loss_fn


def train_epochs(cfg: Config, learner: LocalLearner, examples: list[Example], held: list[Example], hooks: SftHooks,
                 replay_s: float, keep=None, resumed: SftState | None = None) -> list[dict]:
    """`sft.epochs` passes over the examples through `learner.step`; one row before (the held-out
    NLL of the fresh LoRA) and one per epoch. `keep(**progress)` writes a checkpoint (every
    `sft.checkpoint_minutes`); `resumed`: the checkpoint's state, whose steps are skipped."""
    s = cfg.sft
    batches = micro_batches(examples, s.token_budget)
    rng = random.Random(cfg.seed)
    orders = []
    for _ in range(s.epochs):  # every epoch's batch order up front: the lr schedule needs the step count
        order = batches[:]
        rng.shuffle(order)  # batches are length buckets; their order is random
        orders.append(order)
    # a game's worth of examples: 1, or its steps under prompt.history (one example per reply), so a
    # step holds batch_games games' replies whichever way the prompt is cut
    per_game = len(examples) / max(1, len({e.game_id for e in examples}))
    epoch_steps = [optimizer_steps(order, s.batch_games, per_game) for order in orders]
    total_steps = sum(map(len, epoch_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lr_lambda(s, total_steps))
    if resumed is None:
        rows = [{"kind": "epoch", "epoch": 0, "train_nll": None,
                 "heldout_nll": heldout_nll(learner, held), "elapsed_s": round(replay_s, 3)}]
        hooks.done(rows[-1])
        step, first_epoch, done_steps, epoch_sum, epoch_n, train_before = 0, 1, 0, 0.0, 0, 0.0
    else:
        scheduler.load_state_dict(resumed.scheduler)  # its position; the lr in use, not applied by it:
        for group, lr in zip(learner.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # (building the schedule set step 0's)
        rows, step, first_epoch, done_steps = list(resumed.rows), resumed.step, resumed.epoch, resumed.epoch_step
        epoch_sum, epoch_n, train_before = resumed.epoch_sum, resumed.epoch_n, resumed.train_s
    train_t0 = last_kept = time.perf_counter()
    every = None if keep is None or s.checkpoint_minutes is None else 60 * s.checkpoint_minutes
    # the steps' tensors reuse the heap where it fits (procmem.py: a third of the warm start's CPU
    # went to page faults), the same rule as train's update (learner.heap), over every step planned
    with learner.heap([[len(e.token_ids) for b in pending for e in b] for steps in epoch_steps for pending in steps]):
        for epoch, steps in enumerate(epoch_steps, start=1):
            if epoch < first_epoch:
                continue
            hooks.phase("train", len(steps))  # optimizer steps: what checkpoints and `continuing ... at step` count
            skip = done_steps if epoch == first_epoch else 0
            if skip:
                hooks.advance(skip)
            else:
                epoch_sum, epoch_n = 0.0, 0
            for i, pending in enumerate(steps[skip:], start=skip + 1):
                step_examples = [e for b in pending for e in b]  # the step's gradient; how it is cut to run, the learner's
                n_tokens = sum(e.reply_tokens for e in step_examples)
                loss_fn = nll_loss(learner, step_examples, n_tokens)
                step += 1
                faults.iteration = step  # AGENTRL_FAULT=kill:update@N kills optimizer step N (the reliability tests)
                for nll_sum in learner.step(example_micro_batches(learner, step_examples), loss_fn, s.grad_clip).values:
                    epoch_sum += nll_sum
                scheduler.step()
                epoch_n += n_tokens
                hooks.advance(1, nll=epoch_sum / max(epoch_n, 1))
                if every is not None and step < total_steps and time.perf_counter() - last_kept >= every:
                    keep(step=step, total_steps=total_steps, epoch=epoch, epoch_step=i, epoch_sum=epoch_sum,
                         epoch_n=epoch_n, rows=rows, scheduler=scheduler.state_dict(),
                         train_s=train_before + time.perf_counter() - train_t0)
                    last_kept = time.perf_counter()
            learner.model.eval()
            rows.append({"kind": "epoch", "epoch": epoch, "train_nll": epoch_sum / max(epoch_n, 1),
                         "heldout_nll": heldout_nll(learner, held), "steps": len(steps),
                         "lr_end": scheduler.get_last_lr()[0],
                         "elapsed_s": round(replay_s + train_before + time.perf_counter() - train_t0, 3)})
            hooks.done(rows[-1])
    return rows


def optimizer_steps(order: list[list[Example]], batch_games: int, per_game: float = 1.0) -> list[list[list[Example]]]:
    """The epoch's micro-batches grouped into optimizer steps: each step accumulates micro-batches
    until it holds at least `batch_games` games, a game being `per_game` examples (the last step
    takes what is left)."""
    steps, pending, games = [], [], 0.0
    for batch in order:
        pending.append(batch)
        games += len(batch) / per_game
        if games >= batch_games - 1e-9:
            steps.append(pending)
            pending, games = [], 0
    if pending:
        steps.append(pending)
    return steps


def lr_lambda(s, total_steps: int):
    """The lr factor at optimizer step n (0-based): a linear warm-up over `warmup` x total steps,
    then constant or a cosine decay to `min_lr_ratio` at the last step."""
    warm = int(round(s.warmup * total_steps))

    def factor(n: int) -> float:
        if n < warm:
            return (n + 1) / warm
        if s.schedule == "constant":
            return 1.0
        progress = (n - warm) / max(total_steps - warm - 1, 1)
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def write_adapter(learner: LocalLearner, out: Path, summary: dict, rows: list[dict], force: bool) -> None:
    """DIR = adapter_config.json + adapter_model.safetensors (full fine-tuning: config.json +
    model.safetensors + the tokenizer's files) + agentrl.json + sft_metrics.jsonl, written in a
    temporary sibling and renamed: DIR is complete or absent."""
    with atomic_path(out) as tmp:
        learner.write_weights(tmp)
        (tmp / ADAPTER_RECORD).write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if out.exists():
            check_out_dir(out, force)  # --force or an empty directory: it is replaced
