"""Samplers: one protocol, backends hf (transformers + peft, CPU default) and vllm (optional)."""

from agentrl.sampling.base import Completion, Sampler, SamplingParams

__all__ = ["Completion", "Sampler", "SamplingParams", "make_sampler"]


def make_sampler(cfg, model=None, tokenizer=None) -> Sampler:
    """The sampler named by cfg.sampling.backend; vLLM is imported only when asked for."""
    if cfg.sampling.backend == "hf":
        from agentrl.sampling.hf import HFSampler

        return HFSampler.from_config(cfg, model=model, tokenizer=tokenizer)
    from agentrl.errors import UserError

    raise UserError(f"sampler backend {cfg.sampling.backend!r} is not available yet; use --sampler hf")
