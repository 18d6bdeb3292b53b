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
from agentrl.rollout.trajectory import is_zero, token_advantages, trained_tokens
from agentrl.train.loss import grpo_loss, token_logprobs


@dataclass
class UpdateStats:
    loss: float
    grad_l2_norm: float  # before clipping
    trajectories: int  # in the batch (A = 0 ones included)
    step_tokens_trained: int  # action tokens with A != 0 (a trajectory with none skips forward/backward)
    logprob_gap: float | None  # mean |sampler logp - learner logp| on trained action tokens, before the update
    skipped: bool = False  # a non-finite loss or gradient: no optimizer step
    stepped: bool = True  # the optimizer moved (False: skipped, or no trajectory with A != 0)


def lora_config(cfg: LearnerConfig):
    """The LoRA the learner trains (and `agentrl sft` warm-starts, so GRPO continues it unchanged)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


class Learner:
    def __init__(self, model, cfg: LearnerConfig, seed: int = 0, init_adapter: str | None = None,
                 prompt: dict | None = None):
        """`init_adapter`: a PEFT LoRA directory (e.g. `agentrl sft`'s) the policy starts from,
        trainable, with its own rank and target modules; None: a fresh LoRA from `cfg`.
        `prompt`: the run's prompt settings (`config.effective_prompt`), recorded in every adapter
        this learner writes (agentrl.json), so evaluating one uses the prompt it was trained with."""
        from peft import PeftModel, get_peft_model

        torch.manual_seed(seed)  # LoRA's A matrices are initialised at random
        self.cfg, self.init_adapter = cfg, init_adapter
        if init_adapter:
            self.model = PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
        else:
            self.model = get_peft_model(model, lora_config(cfg))
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0
        self.prompt = prompt

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
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_total = len(batch)
        tokens_total = sum(sum(t.action_mask) for t, _ in batch)
        # A = 0 contributes exactly zero to the loss and its gradient in every aggregation (it only
        # counts in N or the token total): no forward/backward for it. Zero-variance groups are all A = 0.
        # Per-step advantages (GiGPO): a trajectory whose steps are all A = 0 is skipped the same way.
        work = [(t, a) for t, a in batch if not is_zero(a)]
        tokens_trained = sum(trained_tokens(t, a) for t, a in work)
        loss_sum, gap_sum = 0.0, 0.0
        for start in range(0, len(work), self.cfg.micro_batch):
            part = work[start : start + self.cfg.micro_batch]
            ids, attn, mask, sampler_logp = self._pad([t for t, _ in part])
            adv = self._advantages(part, ids.shape[1])
            logp = token_logprobs(self.model, ids, attn)
            loss = grpo_loss(logp, mask, adv, self.cfg.loss_agg, n_total=n_total, tokens_total=tokens_total)
            loss.backward()
            faults.point("update")
            loss_sum += float(loss.detach())
            gap_sum += float(((logp.detach() - sampler_logp).abs() * mask).sum())
        if not work:  # nothing carries signal: no optimizer step (Adam would still move on stale moments)
            self.model.eval()
            return UpdateStats(0.0, 0.0, n_total, 0, None, skipped=False, stepped=False)
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf))
        gap = gap_sum / tokens_trained if tokens_trained else None
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
            return UpdateStats(loss_sum, norm, n_total, tokens_trained, gap, skipped=True, stepped=False)
        self.optimizer.step()
        self.model.eval()
        return UpdateStats(loss_sum, norm, n_total, tokens_trained, gap)

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

