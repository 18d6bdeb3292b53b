"""The learner: a PEFT LoRA policy, AdamW, one GRPO update per call, versioned adapters.

Each update trains on the exact token ids of the trajectories (teacher-forced, action-masked)
and then saves the adapter as a standard PEFT directory (safetensors), `adapters/v{n}`, written
to a temporary directory and renamed so a sampler never loads a half-written version.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrl import faults
from agentrl.config import LearnerConfig, write_adapter_record
from agentrl.rollout.trajectory import is_zero, step_sequences, token_advantages, trained_tokens
from agentrl.train.handoff import TrainItem
from agentrl.train.loss import clipped_loss, grpo_loss, kl_to_reference, token_logprobs


@dataclass
class UpdateStats:
    loss: float
    grad_l2_norm: float  # before clipping
    trajectories: int  # in the batch (A = 0 ones included)
    step_tokens_trained: int  # action tokens with A != 0 (a trajectory with none skips forward/backward)
    logprob_gap: float | None  # mean |sampler logp - learner logp| on trained action tokens, before the update
    skipped: bool = False  # a non-finite loss or gradient: no optimizer step
    stepped: bool = True  # the optimizer moved (False: skipped, or no trajectory with A != 0)
    optimizer_steps: int = 1  # learner.epochs x learner.minibatches, less skipped ones
    clip_fraction: float = 0.0  # share of action tokens whose ratio was clipped (0 on the first minibatch)
    kl: float | None = None  # mean KL(policy || warm start) per action token (with learner.kl_coef > 0)


def lora_config(cfg: LearnerConfig):
    """The LoRA the learner trains (and `agentrl sft` warm-starts, so GRPO continues it unchanged)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


def per_step_items(batch, history: int) -> list[tuple[TrainItem, object]]:
    """Under prompt.history N a trajectory's reply i was sampled from its window, not from the
    whole episode: one item per reply (window + reply, the mask on the reply), with the trajectory's
    advantage (GRPO) or the reply's own (GiGPO). The action tokens and advantages are the
    trajectory's, so seq-sum and token-mean losses keep their meaning (N: trajectories)."""
    out = []
    for t, a in batch:
        for i, (ids, mask, logprobs) in enumerate(step_sequences(t, history)):
            n = sum(mask)
            if n:  # an empty reply has no token to train
                out.append((TrainItem(ids, mask, logprobs, [n]), [a[i]] if isinstance(a, (list, tuple)) else a))
    return out


class Learner:
    def __init__(self, model, cfg: LearnerConfig, seed: int = 0, init_adapter: str | None = None,
                 prompt: dict | None = None):
        """`init_adapter`: a PEFT LoRA directory (e.g. `agentrl sft`'s) the policy starts from,
        trainable, with its own rank and target modules; None: a fresh LoRA from `cfg`.
        `prompt`: the run's prompt settings (`config.effective_prompt`), recorded in every adapter
        this learner writes (agentrl.json), so evaluating one uses the prompt it was trained with."""
        from peft import PeftModel, get_peft_model

        from agentrl.models import quiet_peft

        torch.manual_seed(seed)  # LoRA's A matrices are initialised at random
        self.cfg, self.init_adapter, self.seed = cfg, init_adapter, seed
        if init_adapter:
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
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0
        self.prompt = prompt
        # KL's reference: the warm start's LoRA weights, frozen (swapped in for a no-grad pass)
        self.reference = [p.detach().clone() for p in self.params] if cfg.kl_coef > 0 else None

    def _write_adapter(self, path: Path) -> None:
        self.model.save_pretrained(path, safe_serialization=True)
        if self.prompt is not None:
            write_adapter_record(path, self.prompt, written_by="agentrl train", version=self.version,
                                 init_adapter=self.init_adapter)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _pad(self, trajs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(t.token_ids) for t in trajs)
        ids = torch.zeros((len(trajs), width), dtype=torch.long)
        attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        sampler_logp = torch.zeros((len(trajs), width))
        for i, t in enumerate(trajs):  # right padding: positions stay those the sampler used
            n = len(t.token_ids)
            ids[i, :n] = torch.tensor(t.token_ids)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(t.action_mask)
            sampler_logp[i, :n] = torch.tensor(t.logprobs)
        d = self.device
        return ids.to(d), attn.to(d), mask.to(d), sampler_logp.to(d)

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
        """One optimizer step on [(trajectory, advantage), ...] (cut groups never get here); an
        advantage is a number (GRPO) or a list with one per reply (GiGPO)."""
        try:
            return self._update(batch)
        finally:
            if self.device.type == "cuda":  # hand the activations' memory back: a colocated vLLM re-allocates its KV cache next
                torch.cuda.empty_cache()

    def _update(self, batch: list[tuple[object, object]]) -> UpdateStats:
        """`learner.epochs` passes over the batch, each `learner.minibatches` optimizer steps, on the
        clipped ratio against the policy at the start of the update (its log-probs from a no-grad
        pass). On the very first minibatch the policy has not moved (r = 1), so that step is the
        GRPO step itself: with 1 x 1 the update is exactly the single step it always was."""
        cfg = self.cfg
        n_total = len(batch)
        tokens_total = sum(sum(t.action_mask) for t, _ in batch)
        history = int((self.prompt or {}).get("history") or 0)
        if history:  # prompt.history: each reply was sampled from its own window; train each on it (N stays trajectories)
            batch = per_step_items(batch, history)
        # A = 0 contributes exactly zero to the loss and its gradient in every aggregation (it only
        # counts in N or the token total): no forward/backward for it. Zero-variance groups are all A = 0.
        # Per-step advantages (GiGPO): a trajectory whose steps are all A = 0 is skipped the same way.
        work = [(t, a) for t, a in batch if not is_zero(a)]
        tokens_trained = sum(trained_tokens(t, a) for t, a in work)
        if not work:  # nothing carries signal: no optimizer step (Adam would still move on stale moments)
            return UpdateStats(0.0, 0.0, n_total, 0, None, skipped=False, stepped=False, optimizer_steps=0)
        steps = self._plan(len(work))
        multi = len(steps) > 1
        # the policy before the update (and the reference's), per trajectory of `work`: needed once a step has moved it
        old = self._logprobs(work) if multi else None
        ref = self._logprobs(work, reference=True) if cfg.kl_coef > 0 else None
        gap = None
        if old is not None and tokens_trained:
            gap = sum(float(((o - torch.tensor(t.logprobs, device=o.device)).abs() * torch.tensor(t.action_mask, device=o.device)).sum())
                      for o, (t, _) in zip(old, work)) / tokens_trained
        first = UpdateStats(0.0, 0.0, n_total, tokens_trained, None)
        clipped, kl, skipped_steps = [], [], 0
        for k, idx in enumerate(steps):
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            share = len(idx) / len(work)  # a minibatch is normalised as its share of the batch
            loss_sum, gap_sum, clip_n, kl_sum = 0.0, 0.0, 0.0, 0.0
            kl_tokens = max(1, sum(trained_tokens(*work[i]) for i in idx)) if ref is not None else 1
            for start in range(0, len(idx), cfg.micro_batch):
                part_idx = idx[start : start + cfg.micro_batch]
                part = [work[i] for i in part_idx]
                ids, attn, mask, sampler_logp = self._pad([t for t, _ in part])
                adv = self._advantages(part, ids.shape[1])
                logp = token_logprobs(self.model, ids, attn)
                if k == 0:  # the policy has not moved: r = 1, and the clipped loss's gradient is this one's
                    loss, c = grpo_loss(logp, mask, adv, cfg.loss_agg, n_total=n_total * share,
                                        tokens_total=tokens_total * share), 0.0
                else:
                    loss, c = clipped_loss(logp, self._stack(old, part_idx, ids.shape[1]), mask, adv, cfg.clip,
                                           cfg.loss_agg, n_total=n_total * share, tokens_total=tokens_total * share)
                if ref is not None:
                    kl_part = kl_to_reference(logp, self._stack(ref, part_idx, ids.shape[1]), mask)
                    loss = loss + cfg.kl_coef * kl_part / kl_tokens
                    kl_sum += float(kl_part.detach())
                loss.backward()
                faults.point("update")
                loss_sum += float(loss.detach())
                clip_n += float(c) * float(mask.sum())
                if k == 0 and old is None:  # single step: the gap from this forward (else from the pre-pass)
                    gap_sum += float(((logp.detach() - sampler_logp).abs() * mask).sum())
            step_tokens = sum(sum(work[i][0].action_mask) for i in idx)
            clipped.append(clip_n / max(1, step_tokens))
            kl.append(kl_sum / max(1, step_tokens))
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip or math.inf))
            if k == 0:
                first = UpdateStats(loss_sum, norm, n_total, tokens_trained,
                                    gap if gap is not None else (gap_sum / tokens_trained if tokens_trained else None))
            if not (math.isfinite(loss_sum) and math.isfinite(norm)):
                self.optimizer.zero_grad(set_to_none=True)
                skipped_steps += 1
                if k == 0:  # the batch itself is bad: stop here, as a single step would
                    self.model.eval()
                    first.skipped, first.stepped, first.optimizer_steps = True, False, 0
                    return first
                continue
            self.optimizer.step()
        self.model.eval()
        first.optimizer_steps = len(steps) - skipped_steps
        first.clip_fraction = sum(clipped) / len(clipped)
        first.kl = sum(kl) / len(kl) if ref is not None else None
        return first

    def _plan(self, n: int) -> list[list[int]]:
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
        """Per trajectory, its token log-probs under the current policy (or the reference: the warm
        start's LoRA weights swapped in for the pass), in eval mode (no dropout)."""
        self.model.eval()
        saved = None
        if reference:
            saved = [p.detach().clone() for p in self.params]
            for p, r in zip(self.params, self.reference):
                p.copy_(r)
        try:
            out = []
            for start in range(0, len(work), self.cfg.micro_batch):
                part = [t for t, _ in work[start : start + self.cfg.micro_batch]]
                ids, attn, _, _ = self._pad(part)
                logp = token_logprobs(self.model, ids, attn)
                out += [logp[i, : len(t.token_ids)].clone() for i, t in enumerate(part)]
            return out
        finally:
            if saved is not None:
                for p, w in zip(self.params, saved):
                    p.copy_(w)

    def _stack(self, rows: list[torch.Tensor], idx: list[int], width: int) -> torch.Tensor:
        out = torch.zeros((len(idx), width), device=self.device)
        for j, i in enumerate(idx):
            out[j, : rows[i].shape[0]] = rows[i]
        return out

    def save_adapter(self, root: Path) -> Path:
        """Write the adapter as `root/v{n+1}` (PEFT format, safetensors) atomically; return its path."""
        self.version += 1
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{self.version}"
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".v{self.version}-"))
        try:
            self._write_adapter(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def save_state(self, path: Path) -> None:
        """Adapter, optimizer and torch RNG into `path` (part of a checkpoint; the caller makes it atomic)."""
        self._write_adapter(path / "adapter")
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")  # LoRA dropout draws from it

    def load_state(self, path: Path, version: int) -> None:
        """Restore what `save_state` wrote; loads weights only (safetensors, weights_only=True)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from agentrl.errors import UserError

        weights = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(self.device))
        result = set_peft_model_state_dict(self.model, weights)
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"checkpoint {path} does not match the learner's LoRA layout (unexpected {result.unexpected_keys[0]})")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=self.device))
        torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
        self.version = version

