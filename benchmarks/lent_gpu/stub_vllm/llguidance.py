"""Stub, for vLLM on the lent GPU machine only (benchmarks/lent_gpu/, docs/gpu.md#vllm-on-the-lent-gpu).

vLLM 0.25 imports llguidance when vllm.v1.request loads, for nothing but the type annotations of its
structured-output dataclasses (backend_guidance.GuidanceGrammar: `ll_matcher: llguidance.LLMatcher`).
llguidance is used only when a request asks for structured output (JSON schema, regex, grammar);
agentrl never does. So any name resolves to a placeholder class, and using one raises. The real
wheel would cost a device call's room; this folder is last on PYTHONPATH, so an installed
llguidance wins."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("llguidance is a stub here (benchmarks/lent_gpu/stub_vllm): no structured outputs")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})
