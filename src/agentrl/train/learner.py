"""The learner: a PEFT LoRA policy, AdamW, one GRPO update per call, versioned adapters.

Each update trains on the exact token ids of the trajectories (teacher-forced, action-masked)
and then saves the adapter as a standard PEFT directory (safetensors), `adapters/v{n}`, written
to a temporary directory and renamed so a sampler never loads a half-written version.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrl.train.loss import grpo_loss, token_logprobs


@dataclass
class LearnerConfig:
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    lr: float = 5e-5
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # None: no clipping (the norm is logged either way)
    micro_batch: int = 2  # trajectories per forward/backward (gradient accumulation)
    loss_agg: str = "seq-sum"
    gradient_checkpointing: bool = False
    seed: int = 0


@dataclass
class UpdateStats:
    loss: float
    grad_l2_norm: float  # before clipping
    trajectories: int
    step_tokens_trained: int
    logprob_gap: float | None  # mean |sampler logp - learner logp| on action tokens, before the update
    skipped: bool = False  # a non-finite loss or gradient: no optimizer step


class Learner:
    def __init__(self, model, cfg: LearnerConfig):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
        self.model = get_peft_model(model, lora)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0

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

    def update(self, batch: list[tuple[object, float]]) -> UpdateStats:
        """One optimizer step on [(trajectory, advantage), ...] (cut groups never get here)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_total = len(batch)
        tokens_total = sum(sum(t.action_mask) for t, _ in batch)
        loss_sum, gap_sum = 0.0, 0.0
        for start in range(0, n_total, self.cfg.micro_batch):
            part = batch[start : start + self.cfg.micro_batch]
            ids, attn, mask, sampler_logp = self._pad([t for t, _ in part])
            adv = torch.tensor([a for _, a in part], device=self.device)
            logp = token_logprobs(self.model, ids, attn)
            loss = grpo_loss(logp, mask, adv, self.cfg.loss_agg, n_total=n_total, tokens_total=tokens_total)
            loss.backward()
            loss_sum += float(loss.detach())
            gap_sum += float(((logp.detach() - sampler_logp).abs() * mask).sum())
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf))
        gap = gap_sum / tokens_total if tokens_total else None
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return UpdateStats(loss_sum, norm, n_total, tokens_total, gap, skipped=True)
        self.optimizer.step()
        self.model.eval()
        return UpdateStats(loss_sum, norm, n_total, tokens_total, gap)

    def save_adapter(self, root: Path) -> Path:
        """Write the adapter as `root/v{n+1}` (PEFT format, safetensors) atomically; return its path."""
        self.version += 1
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{self.version}"
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".v{self.version}-"))
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final
