"""The learner in this process: a PEFT LoRA policy (or, with learner.lora_r 0, every weight of
the model), AdamW, one GRPO update per call, versioned weights (`LocalLearner`, one
implementation of `handoff.Learner`; `build_learner` makes it).

Each update trains on the exact token ids of the trajectories (teacher-forced, action-masked)
and then saves the weights, `adapters/v{n}`, written to a temporary directory and renamed so a
sampler never loads a half-written version: a standard PEFT directory (safetensors), or under
full fine-tuning a model directory (config.json + model.safetensors in fp32, the master
weights; `WeightsRef` kind "full"). `step` is the optimizer step on any loss: GRPO's
minibatches use it, and `agentrl sft`'s behaviour cloning trains through it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from agentrl import faults
from agentrl.config import Config, LearnerConfig, effective_prompt, write_adapter_record
from agentrl.errors import UserError
from agentrl.io import atomic_path
from agentrl.models import contiguous_head, copy_full_weights, load_model, quiet_peft, save_full_weights
from agentrl.rollout.trajectory import is_zero, step_allowed, step_sequences, token_advantages, trained_tokens
from agentrl.train.bc import ReplayPart, SuccessReplay
from agentrl.train.handoff import STATE_WEIGHTS, TrainItem, UpdateStats
from agentrl.train.loss import clipped_loss, field_kl_coef, grpo_loss, kl_penalty, kl_to_reference
from agentrl.procmem import reused_heap
from agentrl.train.memory import microbatch_bytes, reused_heap_fits, tokens_per_microbatch
from agentrl.train.attention import kernel_for, use_kernel
from agentrl.train.packing import (Forked, Packed, autocast, autocast_dtype, fork, pack, sequence_logprobs, supports_packing,
                                   token_micro_batches)
from agentrl.weights import WeightsRef, refuse_full_init, weights_kind

__all__ = ["LocalLearner", "StepResult", "UpdatePlan", "UpdateStats", "build_learner", "lora_config", "per_step_items"]


def lora_config(cfg: LearnerConfig) -> LoraConfig:
    """The LoRA the learner trains (and `agentrl sft` warm-starts, so GRPO continues it unchanged)."""
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


def per_step_items(batch, history: int) -> list[tuple[TrainItem, object]]:
    """Under prompt.history N a trajectory's reply i was sampled from its window, not from the
    whole episode: one item per reply (window + reply, the mask on the reply), with the trajectory's
    advantage (GRPO) or the reply's own (GiGPO). The action tokens and advantages are the
    trajectory's, so seq-sum and token-mean losses keep their meaning (N: trajectories)."""
    out = []
    for t, a in batch:
        for i, ((ids, mask, logprobs), allowed) in enumerate(zip(step_sequences(t, history), step_allowed(t, history))):
            n = sum(mask)
            if n:  # an empty reply has no token to train
                out.append((TrainItem(ids, mask, logprobs, [n], allowed=allowed),
                            [a[i]] if isinstance(a, (list, tuple)) else a))
    return out


def constraints_of(items) -> list | None:
    """Per item (a trajectory, a TrainItem), its (action mask, allowed ids per action token) when its
    replies were drawn under admissible actions; None when none was (free text: nothing to apply)."""
    out = [(t.action_mask, t.allowed) if getattr(t, "allowed", None) else None for t in items]
    return out if any(out) else None


def build_learner(cfg: Config, model=None, settings: LearnerConfig | None = None, warm_start: bool = True,
                  device: str | None = None) -> LocalLearner:
    """The one place an in-process learner is made (the factory `remote.make_learner`, the learner
    process, the Ray actor, Tier 2's arms and `agentrl sft` all come here). `model`: the base
    model (None: cfg's, loaded on the learner's device, or `device`); `settings`: cfg.learner
    unless given (sft's lr and clip); `warm_start`: begin from cfg.train.init_adapter (False: a
    fresh LoRA, as Tier 2 and sft do)."""
    if model is None:
        device = device or cfg.learner.device or cfg.model.device
        dtype = "float32" if (settings or cfg.learner).lora_r == 0 else cfg.model.dtype  # full FT: fp32 master weights
        model = load_model(cfg.model.name, dtype, device, cfg.model.trust_remote_code)[0]
    return LocalLearner(model, settings or cfg.learner, seed=cfg.seed,
                        init_adapter=cfg.train.init_adapter if warm_start else None, prompt=effective_prompt(cfg))


@dataclass
class UpdatePlan:
    """What one update will do, decided before any forward pass."""

    work: list  # (item, advantage) with A != 0, in batch order: the only ones that get a forward pass
    steps: list[list[int]]  # per optimizer step, its minibatch (indices into work)
    n_total: int  # trajectories in the batch, A = 0 ones included (seq-sum's N)
    tokens_total: int  # action tokens of the whole batch (token-mean's denominator)
    tokens_trained: int  # action tokens with A != 0

    @property
    def multi(self) -> bool:
        """Several steps: the later ones need the policy before the update (the clipped ratio)."""
        return len(self.steps) > 1


@dataclass
class StepResult:
    loss: float  # the sum of the parts' losses
    grad_norm: float  # before clipping
    stepped: bool  # False: the loss or the norm was not finite, and the gradients were dropped
    values: list  # what the loss function handed back, one per part


@dataclass
class _MinibatchRecord:
    step: StepResult
    clipped: float  # share of the minibatch's action tokens whose ratio was clipped
    kl: float  # KL to the reference per action token
    gap_sum: float  # sum of |sampler logp - learner logp| (measured on the first step's forward where no pre-pass did)
    kl_field: float | None = None  # the step's KL coefficient in the field's unit (field_kl_coef)
    replay_nll: float = 0.0  # success replay: NLL summed over the step's replayed action tokens
    replay_tokens: int = 0
    # the step's loss in the first step's form (-A logp, + its KL and replay terms) at the step's
    # policy: a later step optimises PPO's clipped surrogate (-r A, the same gradient at r = 1), whose
    # value is another quantity, so the update's loss_mean averages this instead
    pg_loss: float | None = None


class LocalLearner:
    def __init__(self, model, cfg: LearnerConfig, seed: int = 0, init_adapter: str | None = None,
                 prompt: dict | None = None):
        """`init_adapter`: a PEFT LoRA directory (e.g. `agentrl sft`'s) the policy starts from,
        trainable, with its own rank and target modules; None: a fresh LoRA from `cfg`. With
        cfg.lora_r 0 (full fine-tuning) every parameter trains, in fp32; `init_adapter` is then a
        full model directory (`agentrl sft` with lora_r 0) or a LoRA adapter merged into the weights.
        `prompt`: the run's prompt settings (`config.effective_prompt`), recorded in every adapter
        this learner writes (agentrl.json), so evaluating one uses the prompt it was trained with."""
        torch.manual_seed(seed)  # LoRA's A matrices are initialised at random
        contiguous_head(model)  # the vocabulary projection of strided hidden states through mm (models.py)
        self.cfg, self.init_adapter, self.seed = cfg, init_adapter, seed
        self.kind = "full" if cfg.lora_r == 0 else "lora"
        if self.kind == "full":
            self.model = _full_model(model, init_adapter)
        elif init_adapter:
            refuse_full_init(cfg.lora_r, init_adapter)
            with quiet_peft():
                self.model = PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
            # the adapter may come from another machine (a GPU's warm start): record the base this
            # learner trains on, as get_peft_model does, not the path it was made on (PEFT looks it
            # up, on the Hub too, at every save)
            for adapter_config in self.model.peft_config.values():
                adapter_config.base_model_name_or_path = model.name_or_path
        else:
            with quiet_peft():
                self.model = get_peft_model(model, lora_config(cfg))
        if cfg.gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2's name for it
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        # the attention of its forwards: agentrl's CPU kernel (train/attention.py) or SDPA
        param = next(self.model.parameters())
        self.attention_kernel = kernel_for(cfg.attention, param.device, autocast_dtype(cfg.autocast, param.device)
                                           or param.dtype, self.model.config)
        if self.attention_kernel:
            use_kernel(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0
        self.prompt = prompt
        # KL's reference: the warm start's trained weights (LoRA's, or under full fine-tuning a
        # frozen copy of every weight: one more model in fp32), swapped in for a no-grad pass
        self.reference = [p.detach().clone() for p in self.params] if cfg.kl_coef > 0 else None
        history = int((prompt or {}).get("history") or 0)
        self.replay = SuccessReplay(cfg.replay_coef, cfg.replay_buffer, history) if cfg.replay_coef > 0 else None

    def write_weights(self, path: Path) -> None:
        """The weights as a PEFT adapter directory, or under full fine-tuning a model directory."""
        if self.kind == "full":
            save_full_weights(self.model, path)
        else:
            self.model.save_pretrained(path, safe_serialization=True)

    def _write_adapter(self, path: Path) -> None:
        self.write_weights(path)
        if self.prompt is not None:
            write_adapter_record(path, self.prompt, written_by="agentrl train", version=self.version,
                                 init_adapter=self.init_adapter, weights=self.kind)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def history(self) -> int:
        """prompt.history N: each reply is forwarded against its own window (`per_step_items`); 0: whole trajectories."""
        return int((self.prompt or {}).get("history") or 0)

    @property
    def packing(self) -> bool:
        """Rows packed with several sequences (learner.packing, and the model's attention masks them)."""
        return self.cfg.packing and supports_packing(self.model)

    def micro_batches(self, lengths: list[int]) -> list[list[list[int]]]:
        """The sequences of `lengths` as micro-batches, each a list of rows of indices: by
        `learner.tokens_per_microbatch` (auto: sized from the device's free memory now), packed or
        one per row; null: `learner.micro_batch` rows each, in order (the count-based path)."""
        cfg = self.cfg
        budget = tokens_per_microbatch(cfg.tokens_per_microbatch, self.model, self.device, cfg.gradient_checkpointing)
        if budget is None:
            return [[[i] for i in range(s, min(s + cfg.micro_batch, len(lengths)))]
                    for s in range(0, len(lengths), cfg.micro_batch)]
        return token_micro_batches(lengths, budget, pack=self.packing)

    @property
    def forks(self) -> bool:
        """Sequences that begin alike share one prefix forward (learner.share_prefixes): on
        transformers' own model code (it takes the prefix's cache) without activation checkpointing
        (transformers drops the cache under it)."""
        return (self.cfg.share_prefixes and supports_packing(self.model)
                and not any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules()))

    def inputs(self, sequences: list[list[int]], rows: list[list[int]], constraints: list | None = None,
               masks: list[list[int]] | None = None) -> Packed | Forked:
        """One micro-batch's model inputs (`rows` index `sequences`), packed when the learner packs;
        `constraints` (per sequence: `constraints_of`) carry admissible actions' allowed ids; `masks`
        (the action masks, in the micro-batch's order) let sequences that begin alike run as forks."""
        if masks is not None and self.forks:
            return fork(sequences, rows, masks, self.device, packed=self.packing, constraints=constraints)
        return pack(sequences, rows, self.device, packed=self.packing, constraints=constraints)

    def autocast(self):
        """The forward's autocast (learner.autocast); the weights and LoRA state stay as loaded."""
        return autocast(self.cfg.autocast, self.device)

    def _per_token(self, values: list[list[float]], width: int) -> torch.Tensor:
        """Per-sequence values (masks, sampler log-probs) right-padded to [n, width]."""
        out = torch.zeros((len(values), width))
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.as_tensor(v, dtype=out.dtype)
        return out.to(self.device)

    def _advantages(self, part, width: int) -> torch.Tensor:
        """[n] advantages (one per trajectory), or [n, width] per token when any is per step."""
        if not any(isinstance(a, (list, tuple)) for _, a in part):
            return torch.tensor([float(a) for _, a in part], device=self.device)
        adv = torch.zeros((len(part), width))
        for i, (t, a) in enumerate(part):
            per_token = token_advantages(t, a)
            adv[i, : len(per_token)] = torch.tensor(per_token)
        return adv.to(self.device)

    def update(self, batch: list[tuple[object, object]]) -> UpdateStats:
        """One update on [(trajectory, advantage), ...] (cut groups never get here); an
        advantage is a number (GRPO) or a list with one per reply (GiGPO)."""
        try:
            stats = self._update(batch)
            if self.replay is not None:  # after the update: the buffer holds earlier iterations' wins
                self.replay.add(batch)
                stats.replay_buffer = len(self.replay.items)
            return stats
        finally:
            if self.device.type == "cuda":  # hand the activations' memory back: a colocated vLLM re-allocates its KV cache next
                torch.cuda.empty_cache()

    def step(self, parts: list, loss_fn: Callable, max_norm: float | None) -> StepResult:
        """One optimizer step on a loss the caller defines: `loss_fn(model, part)` -> (the part's
        loss, anything to hand back); the gradients accumulate over `parts` (micro-batches), are
        clipped to `max_norm` (None: not clipped; the norm is measured either way), and the
        optimizer moves unless the loss or the norm is not finite (then the gradients are dropped:
        Adam would carry the NaN on in its moments)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, values = 0.0, []
        for part in parts:
            with self.autocast():
                loss, value = loss_fn(self.model, part)
            loss.backward()
            faults.point("update")
            loss_sum += float(loss.detach())
            values.append(value)
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm or math.inf))
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss_sum, norm, False, values)
        self.optimizer.step()
        return StepResult(loss_sum, norm, True, values)

    def _update(self, batch: list[tuple[object, object]]) -> UpdateStats:
        """`learner.epochs` passes over the batch, each `learner.minibatches` optimizer steps, on the
        clipped ratio against the policy at the start of the update: plan -> pre-pass (the old and
        the reference log-probs, no grad) -> the minibatch steps -> one stats record. On the very
        first minibatch the policy has not moved (r = 1), so that step is the GRPO step itself:
        with 1 x 1 the update is exactly the single step it always was."""
        plan = self.plan(batch)
        if not plan.work:  # nothing carries signal: no optimizer step (Adam would still move on stale moments)
            return UpdateStats(0.0, 0.0, plan.n_total, 0, None, skipped=False, stepped=False, optimizer_steps=0)
        with self.heap([[len(plan.work[i][0].token_ids) for i in idx] for idx in plan.steps]):
            return self._run(plan)

    def heap(self, steps: list[list[int]]):
        """Where a CPU run's freed tensors go (learner.heap auto), given each optimizer step's
        sequence lengths: reused from glibc's heap (procmem.reused_heap: no page fault per tensor)
        when the largest micro-batch's estimate, as the steps cut them, with the heap's
        fragmentation, fits the memory free now; else the fixed threshold's bounded peak, which the
        run's check was made for. The numbers are the same either way. Not where
        learner.tokens_per_microbatch auto sizes the micro-batches to fill free memory."""
        cfg = self.cfg
        if cfg.heap != "auto" or cfg.tokens_per_microbatch == "auto" or not steps:
            return contextlib.nullcontext()
        dtype_bytes = self.model.get_input_embeddings().weight.element_size()
        peak = max(microbatch_bytes(self.model.config, dtype_bytes, len(rows), sum(lengths[i] for row in rows for i in row),
                                    max(sum(lengths[i] for i in row) for row in rows), cfg.gradient_checkpointing)
                   for lengths in steps for rows in self.micro_batches(lengths))  # as _minibatch and sft cut them
        return reused_heap() if reused_heap_fits(peak, cfg.gradient_checkpointing, self.device) else contextlib.nullcontext()

    def _run(self, plan: UpdatePlan) -> UpdateStats:
        """The update planned: the pre-pass, the minibatch steps, one stats record."""
        from_sampler = plan.multi and self.cfg.old_logprobs == "sampler"
        old = self._old_logprobs(plan.work, from_sampler) if plan.multi else None  # the policy before the update,
        ref = self._logprobs(plan.work, reference=True) if self.cfg.kl_coef > 0 else None  # and the reference
        records, per_epoch = [], len(plan.steps) // self.cfg.epochs
        for k, idx in enumerate(plan.steps):
            # the first step's policy has not moved: r = 1 (GRPO's loss); its forward measures the gap
            # where no pre-pass did (a single step, or p_old taken from the sampler)
            replayed = self.replay.share(k, per_epoch) if self.replay is not None else []
            measure_gap = not plan.multi or (from_sampler and k == 0)
            records.append(self._minibatch(plan, idx, old if k else None, ref, measure_gap=measure_gap, replayed=replayed))
            if not records[0].step.stepped:  # the batch itself is bad: stop here, as a single step would
                break
        self.model.eval()
        gap = self._gap(plan, old) if plan.multi and not from_sampler else self._first_step_gap(plan, records[0])
        return self._stats(plan, records, gap, ref is not None)

    def _first_step_gap(self, plan: UpdatePlan, first: _MinibatchRecord) -> float | None:
        """Mean |sampler logp - learner logp| per trained action token of the first step, from its own
        forward (the policy not yet moved); a single step's first step is the whole batch."""
        tokens = sum(trained_tokens(*plan.work[i]) for i in plan.steps[0])
        return first.gap_sum / tokens if tokens else None

    def _old_logprobs(self, work, from_sampler: bool) -> list[torch.Tensor]:
        """p_old of the clipped ratio, per trajectory: the learner's no-grad pre-pass (learner.old_logprobs
        learner), or the log-probs the sampler drew the same tokens with (sampler: no pre-pass, one forward
        fewer per trajectory; they equal the pre-pass up to the logprob_gap, which the first step's
        forward still measures)."""
        if from_sampler:
            return [torch.tensor(t.logprobs, dtype=torch.float32, device=self.device) for t, _ in work]
        return self._logprobs(work)

    def plan(self, batch: list[tuple[object, object]]) -> UpdatePlan:
        """The update's work and optimizer steps. A = 0 contributes exactly zero to the loss and its
        gradient in every aggregation (it only counts in N or the token total): it gets no forward
        pass. Zero-variance groups are all A = 0; with per-step advantages (GiGPO) a trajectory
        whose steps are all A = 0 is left out the same way."""
        n_total = len(batch)
        tokens_total = sum(sum(t.action_mask) for t, _ in batch)
        if self.history:  # prompt.history: each reply was sampled from its own window; train each on it (N stays trajectories)
            batch = per_step_items(batch, self.history)
        work = [(t, a) for t, a in batch if not is_zero(a)]
        return UpdatePlan(work, self._minibatches(len(work)) if work else [], n_total, tokens_total,
                          sum(trained_tokens(t, a) for t, a in work))

    def _gap(self, plan: UpdatePlan, old: list[torch.Tensor] | None) -> float | None:
        """Mean |sampler logp - learner logp| per trained action token, from the pre-pass."""
        if old is None or not plan.tokens_trained:
            return None
        return sum(float(((o - torch.tensor(t.logprobs, device=o.device)).abs() * torch.tensor(t.action_mask, device=o.device)).sum())
                   for o, (t, _) in zip(old, plan.work)) / plan.tokens_trained

    def _minibatch(self, plan: UpdatePlan, idx: list[int], old, ref, measure_gap: bool, replayed=()) -> _MinibatchRecord:
        """One optimizer step on the minibatch `idx`, in micro-batches; `old` None: GRPO's loss (r = 1),
        else the clipped ratio against it; `ref`: the KL penalty's reference log-probs; `replayed`:
        the success replay's sequences whose BC term joins this step."""
        cfg = self.cfg
        share = len(idx) / len(plan.work)  # a minibatch is normalised as its share of the batch
        kl_tokens = max(1, sum(trained_tokens(*plan.work[i]) for i in idx)) if ref is not None else 1
        per_token = cfg.kl_unit == "per-token"
        kl_field = (cfg.kl_coef if per_token else field_kl_coef(
            cfg.kl_coef, cfg.loss_agg, plan.n_total * share, plan.tokens_total * share, kl_tokens,
            [sum(plan.work[i][0].action_mask) for i in idx])) if ref is not None else None

        sequences = [t.token_ids for t, _ in plan.work]
        constraints = constraints_of([t for t, _ in plan.work])

        def loss_fn(model, rows):
            part_idx = [i for row in rows for i in row]
            part = [plan.work[i] for i in part_idx]
            masks = [t.action_mask for t, _ in part]
            logp = sequence_logprobs(model, self.inputs(sequences, rows, constraints, masks), masks=masks)
            width = logp.shape[1]
            mask = self._per_token([t.action_mask for t, _ in part], width)
            sampler_logp = self._per_token([t.logprobs for t, _ in part], width)
            adv = self._advantages(part, width)
            if old is None:
                loss, c = grpo_loss(logp, mask, adv, cfg.loss_agg, n_total=plan.n_total * share,
                                    tokens_total=plan.tokens_total * share), 0.0
                surrogate_excess = 0.0
            else:
                loss, c = clipped_loss(logp, self._stack(old, part_idx, width), mask, adv, cfg.clip, cfg.loss_agg,
                                       n_total=plan.n_total * share, tokens_total=plan.tokens_total * share)
                with torch.no_grad():  # what this part's loss would read in the first step's form (pg_loss)
                    surrogate_excess = float(loss) - float(grpo_loss(logp, mask, adv, cfg.loss_agg, n_total=plan.n_total * share,
                                                                     tokens_total=plan.tokens_total * share))
            kl = 0.0
            if ref is not None:
                ref_logp = self._stack(ref, part_idx, width)
                kl_part = kl_to_reference(logp, ref_logp, mask)
                if per_token:  # aggregated as the policy loss: beta per action token (the field's unit)
                    loss = loss + cfg.kl_coef * kl_penalty(logp, ref_logp, mask, cfg.loss_agg, n_total=plan.n_total * share,
                                                           tokens_total=plan.tokens_total * share)
                else:
                    loss = loss + cfg.kl_coef * kl_part / kl_tokens
                kl = float(kl_part.detach())
            gap = float(((logp.detach() - sampler_logp).abs() * mask).sum()) if measure_gap else 0.0
            return loss, (float(c) * float(mask.sum()), kl, gap, surrogate_excess)

        parts = [[[idx[j] for j in row] for row in rows]
                 for rows in self.micro_batches([len(sequences[i]) for i in idx])]
        replay_parts, replay_fn = self.replay.parts_and_loss(self, list(replayed)) if self.replay else ([], None)
        result = self.step(parts + replay_parts, _with_replay(loss_fn, replay_fn), cfg.grad_clip)
        clip_n = kl_sum = gap_sum = excess = 0.0
        for c, kl, gap, e in result.values[: len(parts)]:  # summed in order, as the micro-batches ran
            clip_n, kl_sum, gap_sum, excess = clip_n + c, kl_sum + kl, gap_sum + gap, excess + e
        step_tokens = max(1, sum(sum(plan.work[i][0].action_mask) for i in idx))
        replay = result.values[len(parts):]
        return _MinibatchRecord(result, clip_n / step_tokens, kl_sum / step_tokens, gap_sum, kl_field,
                                sum(v[0] for v in replay), sum(v[1] for v in replay), pg_loss=result.loss - excess)

    def _stats(self, plan: UpdatePlan, records: list[_MinibatchRecord], gap: float | None, with_kl: bool) -> UpdateStats:
        """One record of the update: the first step's loss and gradient norm (today's GRPO step) and
        their mean (and the norm's largest) over the steps taken (the loss in the first step's form,
        `pg_loss`), the gap before any step, the steps taken, the clip and KL means over all steps."""
        first = records[0]
        if not first.step.stepped:
            return UpdateStats(first.step.loss, first.step.grad_norm, plan.n_total, plan.tokens_trained, gap,
                               skipped=True, stepped=False, optimizer_steps=0)
        replay_tokens = sum(r.replay_tokens for r in records)
        taken = [r for r in records if r.step.stepped]
        steps = [r.step for r in taken]
        return UpdateStats(first.step.loss, first.step.grad_norm, plan.n_total, plan.tokens_trained, gap,
                           optimizer_steps=len(steps),
                           loss_mean=sum(r.pg_loss for r in taken) / len(taken),
                           grad_l2_norm_mean=sum(s.grad_norm for s in steps) / len(steps),
                           grad_l2_norm_max=max(s.grad_norm for s in steps),
                           clip_fraction=sum(r.clipped for r in records) / len(records),
                           kl=sum(r.kl for r in records) / len(records) if with_kl else None,
                           kl_coef_field=sum(r.kl_field for r in records) / len(records) if with_kl else None,
                           replay_nll=sum(r.replay_nll for r in records) / replay_tokens if replay_tokens else None)

    def _minibatches(self, n: int) -> list[list[int]]:
        """The optimizer steps of one update: per epoch a permutation of the trajectories (seeded by
        the run seed and adapter version: a resumed run draws the same), cut into `minibatches`
        near-equal parts. The first epoch keeps the batch order."""
        cfg = self.cfg
        m = min(cfg.minibatches, n)
        out = []
        for epoch in range(cfg.epochs):
            if epoch == 0:
                order = list(range(n))
            else:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.version * 1009 + epoch) & 0x7FFFFFFF)
                order = torch.randperm(n, generator=g).tolist()
            bounds = [round(i * n / m) for i in range(m + 1)]
            out += [order[bounds[i]:bounds[i + 1]] for i in range(m)]
        return out

    @torch.no_grad()
    def _logprobs(self, work, reference: bool = False) -> list[torch.Tensor]:
        """Per trajectory, its action tokens' log-probs (every other entry 0: nothing reads them) under
        the current policy (or the reference: the warm
        start's weights swapped in for the pass: each parameter points at its reference tensor and
        back, no copy made), in eval mode (no dropout)."""
        self.model.eval()
        saved = None
        if reference:
            saved = [p.data for p in self.params]
            for p, r in zip(self.params, self.reference):
                p.data = r
        try:
            sequences = [t.token_ids for t, _ in work]
            constraints = constraints_of([t for t, _ in work])
            out: list[torch.Tensor | None] = [None] * len(work)
            for rows in self.micro_batches([len(ids) for ids in sequences]):
                masks = [work[i][0].action_mask for row in rows for i in row]
                with self.autocast():
                    logp = sequence_logprobs(self.model, self.inputs(sequences, rows, constraints, masks), masks=masks)
                for k, i in enumerate(i for row in rows for i in row):
                    out[i] = logp[k, : len(sequences[i])].float().clone()
            return out
        finally:
            if saved is not None:
                for p, w in zip(self.params, saved):
                    p.data = w

    def logprobs(self, items: list) -> list[torch.Tensor]:
        """Per item (a trajectory or TrainItem, as `plan` forwards it: under prompt.history, `per_step_items`'s),
        its action tokens' log-probs (0 elsewhere) under the current policy, float32 on the learner's device: the update's
        own pre-pass (`_logprobs`: micro-batches, packing, autocast, eval mode, and whatever per-token
        masks it applies). `agentrl rollout --verify-logprobs` checks the sampler against these."""
        return self._logprobs([(t, None) for t in items])

    def _stack(self, rows: list[torch.Tensor], idx: list[int], width: int) -> torch.Tensor:
        out = torch.zeros((len(idx), width), device=self.device)
        for j, i in enumerate(idx):
            out[j, : rows[i].shape[0]] = rows[i]
        return out

    def save(self, root: Path) -> WeightsRef:
        """Write the weights as `root/v{n+1}` (PEFT format, or a full model directory; safetensors)
        atomically; return their ref."""
        self.version += 1
        with atomic_path(Path(root) / f"v{self.version}") as tmp:
            self._write_adapter(tmp)
        return WeightsRef(Path(root) / f"v{self.version}", self.version, self.kind)

    def save_state(self, path: Path) -> None:
        """Weights (adapter or full), optimizer and torch RNG into `path` (part of a checkpoint; the
        caller makes it atomic)."""
        self._write_adapter(path / STATE_WEIGHTS)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")  # LoRA dropout draws from it
        if self.replay is not None:
            self.replay.save(path)

    def load_state(self, path: Path, version: int) -> WeightsRef:
        """Restore what `save_state` wrote; loads weights only (safetensors, weights_only=True)."""
        if weights_kind(path / STATE_WEIGHTS) != self.kind:
            raise UserError(f"checkpoint {path} holds {weights_kind(path / STATE_WEIGHTS)} weights; this learner "
                            f"trains {self.kind} ones (learner.lora_r {self.cfg.lora_r})")
        if self.kind == "full":
            copy_full_weights(self.model, path / STATE_WEIGHTS)
        else:
            weights = load_file(str(path / STATE_WEIGHTS / "adapter_model.safetensors"), device=str(self.device))
            result = set_peft_model_state_dict(self.model, weights)
            if getattr(result, "unexpected_keys", None):
                raise UserError(f"checkpoint {path} does not match the learner's LoRA layout (unexpected {result.unexpected_keys[0]})")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=self.device))
        torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
        if self.replay is not None:
            self.replay.load(path)
        self.version = version
        return WeightsRef(path / STATE_WEIGHTS, version, self.kind)

    def close(self) -> None:
        """Nothing to free: the model goes with this object (a learner elsewhere frees its process)."""


def _with_replay(loss_fn: Callable, replay_fn: Callable | None) -> Callable:
    """One step's loss over its policy micro-batches and, after them, the success replay's (ReplayParts)."""
    if replay_fn is None:
        return loss_fn
    return lambda model, part: replay_fn(model, part.rows) if isinstance(part, ReplayPart) else loss_fn(model, part)


def _full_model(model, init_adapter: str | None):
    """Full fine-tuning's policy: the plain model, every parameter trainable, in fp32 (the master
    weights; learner.autocast runs the matmuls in bf16), from `init_adapter`'s weights when given
    (a full model directory copied in, or a LoRA adapter merged in)."""
    model = model.float()
    if init_adapter and weights_kind(init_adapter) == "lora":
        with quiet_peft():
            model = PeftModel.from_pretrained(model, init_adapter).merge_and_unload()
    elif init_adapter:
        copy_full_weights(model, init_adapter)
    for p in model.parameters():
        p.requires_grad_(True)
    return model
