"""Lockstep runner: every live trajectory takes step t together.

B tasks x G trajectories. Per step: ONE batched generate over every live trajectory of every
group (the policy's `act`), parse and map each action, step every env, append the
observation. Finished trajectories leave the batch. Right after step K the gate looks at
each group's d_K and stops converged groups. An env that fails to load or step marks only
its own trajectory (env_error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrl import faults
from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import AlfworldEnv
from agentrl.env.data import Game
from agentrl.env.pool import EnvFailure, LocalEnvs
from agentrl.errors import UserError
from agentrl.prompt import ChatRenderer, episode_messages, reply_text, with_admissible
from agentrl.rollout.signals import Trace, command_symbol, signals_at
from agentrl.rollout.trajectory import GroupOutcome, Step, Trajectory, repeats_a_cycle, step_commands, window
from agentrl.sampling.base import GenRequest, Sampler, SamplingParams
from agentrl.sampling.constraint import CommandSet

log = logging.getLogger(__name__)


def row_seed(run_seed: int, game_id: str, index: int, step: int) -> int:
    """Seed of one generate call of one trajectory: same (seed, task, trajectory, step) -> same sample."""
    key = f"{run_seed}|{game_id}|{index}|{step}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@dataclass
class RolloutStats:
    env_steps: int = 0
    step_tokens: int = 0  # generated (action) tokens
    generate_s: float = 0.0
    env_s: float = 0.0
    wall_s: float = 0.0


class ModelPolicy:
    """Acts by sampling from a Sampler; builds each trajectory's exact tokens as it goes.

    `action_space` "admissible": each reply is constrained to `Action: <command><end of turn>` for one
    of the step's admissible commands (sampling/constraint.py), tokenised exactly as the warm start
    teaches it (prompt.reply_text, then the end-of-turn token); the trajectory keeps, per action
    token, the ids it was drawn among (`Trajectory.allowed`), which is what the learner needs.

    `loop_guard` N > 0 (admissible only): a command that would go round a cycle of at most N
    commands a second time in a row is taken out of the step's constraint (unless every command
    would); the policy is the model's renormalised over what is left, and `allowed` records it, so
    the learner's log-probs stay exact."""

    def __init__(self, sampler: Sampler, params: SamplingParams, seed: int = 0, prompt_dir: str | None = None,
                 messages: Callable[[str, str, str | None], list[dict]] = episode_messages, admissible: bool = False,
                 history: int = 0, reply: str = "react", action_space: str = "free", loop_guard: int = 0):
        self.sampler, self.params, self.seed, self.prompt_dir = sampler, params, seed, prompt_dir
        self.messages = messages  # (task_type, first observation, prompt_dir) -> chat messages
        self.admissible = admissible  # prompt.admissible: each observation lists the admissible commands
        self.history = history  # prompt.history: the task and the last N turns (0: the whole episode)
        self.renderer = ChatRenderer(sampler.tokenizer)
        self.constrained = action_space == "admissible"
        self.loop_guard = loop_guard
        if loop_guard and not self.constrained:
            raise UserError("sampling.loop_guard needs sampling.action_space admissible (it narrows the admissible commands)")
        if self.constrained and reply != "action":
            raise UserError("sampling.action_space admissible needs prompt.reply action (replies `Action: <command>`); "
                            f"this run's replies are {reply!r} (a warm start's adapter sets action; without one, "
                            "set prompt.reply: action in the --config file)")
        if self.constrained and not self.renderer.end_of_turn_ids:
            raise UserError("sampling.action_space admissible needs a chat template that ends a reply with a token "
                            "(the tokenizer's has none)")
        self._command_ids: dict[str, tuple[int, ...]] = {}
        self._stopped: dict[int, bool] = {}

    def constraint(self, commands: list[str]) -> CommandSet | None:
        """The replies `commands` (`self.commands`) stand for, None for none (unconstrained)."""
        return CommandSet.of({c: self._reply_ids(c) for c in commands}) if commands else None

    def commands(self, traj: Trajectory) -> list[str]:
        """The step's admissible commands the reply may be ([] unconstrained); with the loop guard,
        those that would not go round a cycle again (all of them where every one would)."""
        if not self.constrained or not traj.admissible:
            return []
        if not self.loop_guard:
            return traj.admissible
        history = step_commands(traj)
        return [c for c in traj.admissible if not repeats_a_cycle(history, c, self.loop_guard)] or traj.admissible

    def _reply_ids(self, command: str) -> tuple[int, ...]:
        """The ids of the reply that is `command`: what the warm start teaches (sft's ExpertSampler)."""
        ids = self._command_ids.get(command)
        if ids is None:
            ids = tuple(self.renderer.command_reply(command))
            self._command_ids[command] = ids
        return ids

    def start(self, traj: Trajectory) -> None:
        messages = self.messages(traj.game.task_type, self._shown(traj.initial_observation, traj), self.prompt_dir)
        traj.append(self.renderer.initial(messages), generated=False)

    def act(self, trajs: list[Trajectory]) -> list[str]:
        commands = [self.commands(t) for t in trajs]
        for t, cs in zip(trajs, commands):
            if len(cs) < len(t.admissible) and cs:  # the loop guard narrowed this step's choice
                t.guarded_steps.append(len(t.steps))
        constraints = [self.constraint(cs) for cs in commands]
        requests = [GenRequest(self.context(t), seed=row_seed(self.seed, t.game.game_id, t.index, len(t.steps)),
                               key=(t.game.game_id, t.index), constraint=c) for t, c in zip(trajs, constraints)]
        completions = self.sampler.generate(requests, self.params)
        if len(completions) != len(trajs):
            raise RuntimeError(f"the sampler returned {len(completions)} completions for {len(trajs)} prompts")
        completions = [self._bounded(c) for c in completions]
        # observe() pops each entry: with env.overlap the other wave acts between this act() and this
        # wave's observe(), so its entries are kept, not reset (a reset closed their turns twice)
        texts = []
        for t, c, con in zip(trajs, completions, constraints):
            if self.constrained:  # per action token, the ids it was drawn among ([]: drawn freely)
                t.allowed.extend(con.allowed_along(c.token_ids) if con else [[] for _ in c.token_ids])
            command = con.match(c.token_ids) if con else None
            texts.append(reply_text(command, "action") if command else c.text)  # the command itself, not its decoding
            t.append(c.token_ids, generated=True, logprobs=c.logprobs)
            t.step_tokens.append(len(c.token_ids))
            t.adapter_versions.append(c.adapter_version)
            self._stopped[id(t)] = c.finish_reason == "stop"
            if c.finish_reason != "stop":
                t.cut_steps.append(len(t.step_tokens) - 1)
        return texts

    def context(self, traj: Trajectory) -> list[int]:
        """The ids the next reply is sampled from: the whole episode, or its window (prompt.history)."""
        return window(traj, self.history) if self.history else traj.token_ids

    @property
    def context_limit(self) -> int | None:
        """The longest prompt the sampler can still extend by max_new_tokens (None: no limit)."""
        n = getattr(self.sampler, "max_model_len", None)
        return None if n is None else n - self.params.max_new_tokens

    def _bounded(self, c):
        """A completion safe to append: at most max_new_tokens ids, one log-prob per id. An empty
        reply is kept (it parses to no action: a no-op step); an over-long one is cut and closed
        like any reply cut at max_new_tokens."""
        n = self.params.max_new_tokens
        if len(c.logprobs) != len(c.token_ids):
            raise RuntimeError(f"the sampler returned {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens")
        if len(c.token_ids) <= n:
            return c
        log.warning("the sampler returned %d tokens for max_new_tokens=%d; cut to %d", len(c.token_ids), n, n)
        ids = c.token_ids[:n]
        text = self.sampler.tokenizer.decode(ids, skip_special_tokens=True)
        return dataclasses.replace(c, token_ids=ids, logprobs=c.logprobs[:n], text=text, finish_reason="length")

    def observe(self, traj: Trajectory, observation: str) -> None:
        traj.append(self.renderer.observation(self._shown(observation, traj), self._stopped.pop(id(traj), False)),
                    generated=False)

    def _shown(self, observation: str, traj: Trajectory) -> str:
        return with_admissible(observation, traj.admissible) if self.admissible else observation

    def finish(self, trajs: list[Trajectory]) -> None:
        """These trajectories ended: the sampler frees what it kept for them (their KV slots)."""
        if trajs:
            self.sampler.release([(t.game.game_id, t.index) for t in trajs])


class WalkthroughPolicy:
    """Replays each game's own expert walkthrough (checks an ALFWorld install: must win every game)."""

    def start(self, traj: Trajectory) -> None:
        pass

    def act(self, trajs: list[Trajectory]) -> list[str]:
        out = []
        for t in trajs:
            w = t.game.walkthrough
            out.append(f"Action: {w[len(t.steps)]}" if len(t.steps) < len(w) else "")
        return out

    def observe(self, traj: Trajectory, observation: str) -> None:
        pass

    def finish(self, trajs: list[Trajectory]) -> None:
        pass


@dataclass
class Group(GroupOutcome):
    """The G trajectories of one task, with the signals at each recorded K and the gate's verdict."""

    game: Game
    trajectories: list[Trajectory]
    signals: dict[int, dict[str, float]] = field(default_factory=dict)  # K -> the signals (rollout.signals)
    cut: bool = False  # the gate stopped this group: excluded from advantages and loss
    live_at_cut: int = 0  # trajectories still running when the gate fired
    excluded_by: str | None = None  # the selection stage that kept this group out of the loss
    pruned: list[Trajectory] = field(default_factory=list)  # stopped inside the group (ARRoL): not in the loss
    carried_step_tokens: int = 0  # step tokens of trajectories generated in an earlier iteration (Pilot-Commit's buffer)
    cut_step: int | None = None
    generate_s: float = 0.0  # its share of each batched generate call (by generated tokens)
    env_s: float = 0.0
    wall_s: float = 0.0  # from rollout start until its last trajectory stopped

    @property
    def env_failed(self) -> bool:
        """An env of the group failed (env_error): its rewards are not all the policy's doing, so
        the group stays out of the loss."""
        return any(t.stop_reason == "env_error" for t in self.trajectories)

    @property
    def step_tokens(self) -> int:
        """Generated tokens, pruned trajectories included (they were paid for)."""
        return sum(sum(t.step_tokens) for t in self.trajectories + self.pruned)

    @property
    def audited(self) -> bool:
        """The gate would have cut it; the audit let it run on (still excluded from the loss)."""
        return self.excluded_by == "cut" and not self.cut

    @property
    def kept_step_tokens(self) -> int:
        """Generated tokens of the trajectories still in the group (what a group-level stage excludes)."""
        return sum(sum(t.step_tokens) for t in self.trajectories)

    @property
    def env_steps(self) -> int:
        return sum(len(t.steps) for t in self.trajectories)

    @property
    def cost_s(self) -> float:
        """Rollout seconds attributable to this group (generate share + its env work)."""
        return self.generate_s + self.env_s


@dataclass
class Rollout:
    groups: list[Group]
    stats: RolloutStats

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


def action_symbol(step: Step) -> str:
    return command_symbol(step.command, step.action)


def group_signals(group: Group, K: int) -> dict[str, float]:
    """The signals from the state of the group's trajectories at step K (the one definition
    Tier 2 also reads its buffer with: `signals.signals_at`)."""
    return signals_at([Trace.of(t) for t in group.trajectories], K)


@dataclass(frozen=True)
class LockstepConfig:
    """How the runner plays each episode (the Generator builds it from the config)."""

    max_steps: int  # T_max (Config.t_max)
    fuzzy_threshold: float = 85.0  # rapidfuzz ratio needed to map a reply's action to an admissible command
    group_size: int = 1  # G trajectories per game
    signal_steps: tuple[int, ...] = ()  # the K at which every group's signals are recorded
    first_index: int = 0  # trajectory i of a task samples with its own seeds; > 0 adds trajectories to a group (Pilot-Commit)


@dataclass
class Progress:
    """Callbacks as the run goes: `on_step(t, trajectories)` once every wave has step t's results,
    `on_reset(done, total)` as the games load."""

    on_step: Callable[[int, list[Trajectory]], None] | None = None
    on_reset: Callable[[int, int], None] | None = None


def run_lockstep(
    games: list[Game],
    policy,
    max_steps: int,
    fuzzy_threshold: float = 85.0,
    group_size: int = 1,
    signal_steps: tuple[int, ...] = (),
    on_step: Callable[[int, list[Trajectory]], None] | None = None,
    on_reset: Callable[[int, int], None] | None = None,
    make_env: Callable[[Game], object] = AlfworldEnv,
    envs=None,
    stages=(),
    first_index: int = 0,
) -> Rollout:
    """`lockstep` in keywords (tests, benchmarks, sft's replay): `envs` an `EnvPool`, or None
    (`make_env` in this process)."""
    run = LockstepConfig(max_steps, fuzzy_threshold, group_size, tuple(signal_steps), first_index)
    return lockstep(games, policy, run, envs if envs is not None else LocalEnvs(make_env), stages, Progress(on_step, on_reset))


def lockstep(games: list[Game], policy, run: LockstepConfig, backend, stages=(), progress: Progress | None = None) -> Rollout:
    """Roll out `run.group_size` trajectories per game, all groups in lockstep; `stages` (the gate,
    ARRoL: from the caller) act on each group right after their step K.

    `backend`: where the envs live, `LocalEnvs` (this process) or an `EnvPool` (worker
    processes); every env this run opened is released when it returns. With a pool (and
    `overlap`), the groups are split into two waves that take turns: while the sampler
    generates step t for one wave, the workers reset or step the other, so env work leaves the
    critical path. Samples do not depend on the batch (per-row seeds), so the waves change
    timings only. `stats.env_s` is the env time the caller waited for."""
    progress = progress or Progress()
    stats = RolloutStats()
    wall = time.perf_counter()
    G = run.group_size
    groups = [Group(g, [Trajectory(game=g, index=run.first_index + i) for i in range(G)]) for g in games]
    trajs = [t for grp in groups for t in grp.trajectories]
    n_waves = 2 if getattr(backend, "overlap", False) and len(groups) > 1 else 1
    waves = [_Wave(groups[w::n_waves], [k for k in range(len(trajs)) if (k // max(1, G)) % n_waves == w])
             for w in range(n_waves)]
    ctx = _Context(trajs, [grp for grp in groups for _ in grp.trajectories], policy, backend, stats, run, list(stages), wall)

    # resets: one group per worker per request, all sent at once (progress as they come back)
    per_call = max(1, getattr(backend, "workers", 1)) * G
    for wave in waves:
        for start in range(0, len(wave.members), per_call):
            ks = wave.members[start:start + per_call]
            wave.inflight.append((backend.submit("reset", [(k, trajs[k].game) for k in ks]), ks))
    _drive(ctx, waves, progress)
    for traj in trajs:
        if traj.stop_reason is None:  # max_steps == 0
            traj.stop_reason = "max_steps"
    for grp in groups:  # groups that all finished before some K: signals of their final state
        for K in run.signal_steps:
            if K not in grp.signals and not grp.cut:
                grp.signals[K] = group_signals(grp, K)
        grp.wall_s = grp.wall_s or time.perf_counter() - wall
    backend.release(sorted(ctx.live_envs))
    policy.finish([t for t in trajs if id(t) not in ctx.finished])  # gate cuts, context_full, max_steps 0
    stats.step_tokens = sum(sum(t.step_tokens) for t in trajs)
    stats.wall_s = time.perf_counter() - wall
    return Rollout(groups, stats)


def _drive(ctx: _Context, waves: list[_Wave], progress: Progress) -> None:
    """The waves take turns until all are finished: collect what the envs sent back, report each
    step once every wave has its results, then generate and send the wave's next step."""
    resets_done, reported = 0, 0
    while any(not wave.finished for wave in waves):
        for wave in waves:
            if wave.finished:
                continue
            for pending, what in wave.inflight:
                t0 = time.perf_counter()
                results = ctx.backend.collect(pending)
                spent = time.perf_counter() - t0
                ctx.stats.env_s += spent
                if pending.op == "reset":
                    ctx.apply_resets(what, results, spent / len(what))
                    resets_done += len(what)
                    if progress.on_reset is not None:
                        progress.on_reset(resets_done, len(ctx.trajs))
                else:
                    ctx.apply_steps(wave, what, results, spent)
            wave.inflight = []
            running = [w.applied for w in waves if not w.finished]
            while reported < min(running):  # every wave has the results of this step
                reported += 1
                if progress.on_step is not None:
                    progress.on_step(reported, ctx.trajs)
                faults.point("rollout")
            wave.finished = ctx.next_step(wave)  # generate, then send the step to the envs without waiting


def run_in_slices(games: list[Game], slice_size: int | None, policy, run: LockstepConfig, backend,
                  progress: Progress | None = None) -> Rollout:
    """`lockstep` over consecutive slices of at most `slice_size` games (None: all at once), one
    after another, merged into one Rollout: for evaluations larger than the sampler's KV budget
    holds at once (greedy episodes of different games do not interact, so slicing changes no result).
    `on_step`/`on_reset` see the slice's own step and count, offset by the slices before it."""
    progress = progress or Progress()
    if not slice_size or slice_size >= len(games):
        return lockstep(games, policy, run, backend, (), progress)
    parts, done = [], 0
    for start in range(0, len(games), slice_size):
        on_reset = progress.on_reset
        offset = done
        part = Progress(progress.on_step, (lambda k, n, o=offset: on_reset(o + k, len(games))) if on_reset else None)
        r = lockstep(games[start:start + slice_size], policy, run, backend, (), part)
        done += len(r.trajectories)
        parts.append(r)
    return merge_rollouts(parts)


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts run one after another, as one: their groups in order, their costs summed."""
    return Rollout([g for r in parts for g in r.groups], summed_stats([r.stats for r in parts]))


def summed_stats(parts: list[RolloutStats]) -> RolloutStats:
    """The costs of runs one after another, as one run's."""
    stats = RolloutStats()
    for r in parts:
        for name in ("env_steps", "step_tokens", "generate_s", "env_s", "wall_s"):
            setattr(stats, name, getattr(stats, name) + getattr(r, name))
    return stats


@dataclass
class _Wave:
    """Groups that take their steps together: one batched generate, then one batch to the envs."""

    groups: list[Group]
    members: list[int]  # their trajectories' indices
    inflight: list = field(default_factory=list)  # (Pending, trajectory indices | the step's commands)
    step: int = 0  # the step last sent to the envs
    applied: int = 0  # the step whose results are in
    finished: bool = False


@dataclass
class _Context:
    """One run's state: its trajectories (and the group of each), who acts and where the envs live."""

    trajs: list[Trajectory]
    group_of: list[Group]
    policy: object
    backend: object
    stats: RolloutStats
    run: LockstepConfig
    stages: list  # step stages (the gate, ARRoL), from the caller: called right after their step K
    wall: float
    live_envs: set[int] = field(default_factory=set)  # trajectories whose env is open
    finished: set = field(default_factory=set)  # ids of trajectories the policy was told ended

    def apply_resets(self, ks: list[int], results: list, spent_each: float) -> None:
        for k, first in zip(ks, results):
            traj = self.trajs[k]
            if isinstance(first, EnvFailure):
                traj.stop_reason, traj.error = "env_error", first.message
                log.warning("%s", first.message)
            else:
                self.live_envs.add(k)
                traj.initial_observation, traj.admissible = first.observation, first.admissible
                self.policy.start(traj)
            self.group_of[k].env_s += spent_each

    def next_step(self, wave: _Wave) -> bool:
        """Generate the wave's next action for every live trajectory and send it to the envs.
        True when the wave has nothing left to do."""
        live = [k for k in wave.members if not self.trajs[k].done]
        limit = getattr(self.policy, "context_limit", None)
        if limit is not None:  # vLLM would end such a reply early at max_model_len: end the episode cleanly
            context = getattr(self.policy, "context", lambda t: t.token_ids)
            full = [k for k in live if len(context(self.trajs[k])) > limit]
            for k in full:
                self.trajs[k].stop_reason = "context_full"
            if full:
                log.warning("%d episode(s) reached the sampler's context (max_model_len minus max_new_tokens = %d "
                            "tokens) and ended; raise sampling.max_model_len or lower env.max_steps", len(full), limit)
                live = [k for k in live if k not in full]
        if not live or wave.step >= self.run.max_steps:
            return True
        wave.step += 1
        t0 = time.perf_counter()
        responses = self.policy.act([self.trajs[k] for k in live])
        spent = time.perf_counter() - t0
        self.stats.generate_s += spent
        made = [self.trajs[k].step_tokens[-1] if len(self.trajs[k].step_tokens) == wave.step else 0 for k in live]
        for k, n in zip(live, made):  # share the batched call's time by generated tokens
            self.group_of[k].generate_s += spent * (n / sum(made) if sum(made) else 1 / len(live))
        commands = []
        for k, response in zip(live, responses):
            action = parse_action(response)
            command, score = map_action(action, self.trajs[k].admissible, self.run.fuzzy_threshold)
            commands.append((k, response, action, command, score))
        wave.inflight = [(self.backend.submit("step", [(k, command) for k, _, _, command, _ in commands]), commands)]
        return False

    def apply_steps(self, wave: _Wave, commands: list, results: list, spent: float) -> None:
        step = wave.step
        for (k, response, action, command, score), result in zip(commands, results):
            traj = self.trajs[k]
            self.group_of[k].env_s += spent / len(commands)
            if isinstance(result, EnvFailure):  # the engine or its worker failed: this trajectory only
                traj.stop_reason, traj.error = "env_error", result.message
                continue
            self.stats.env_steps += 1
            traj.steps.append(Step(response, action, command, result.observation, result.won, result.done, score))
            traj.admissible = result.admissible
            if result.won:
                traj.stop_reason = "won"
            elif result.done:  # the env ended the episode without a win
                traj.stop_reason = "lost"
            elif len(traj.steps) >= self.run.max_steps:
                traj.stop_reason = "max_steps"
            else:
                self.policy.observe(traj, result.observation)
        acting = [stage for stage in self.stages if stage.K == step]
        for grp in wave.groups:
            if grp.cut:
                continue
            if step in self.run.signal_steps or acting:
                grp.signals[step] = group_signals(grp, step)
            for stage in acting:  # the gate may stop the group, ARRoL prune inside it
                if not grp.cut:
                    stage.at_step(step, grp)
        finished = [k for k in wave.members if k in self.live_envs and self.trajs[k].done]
        self.backend.release(finished)  # a finished trajectory's game is released at once (not waited for)
        self.policy.finish([self.trajs[k] for k in finished])  # and its sampler state (KV slot)
        self.finished.update(id(self.trajs[k]) for k in finished)
        self.live_envs.difference_update(finished)
        now = time.perf_counter() - self.wall
        for grp in wave.groups:
            if not grp.wall_s and all(t.done for t in grp.trajectories):
                grp.wall_s = now
        wave.applied = step
