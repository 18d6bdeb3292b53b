"""The CPU-side check of the vLLM set prepare_vllm.sh builds: does vLLM's offline path import, on a
machine without CUDA, with only the lent machine's packages, the carried wheels and stub_vllm/?

vLLM is shown an sm_90 CUDA platform: its compiled extensions that the trimmed tree ships are
replaced by recording dummies (those it does not ship fail to import, as they will there), and
its custom ops by mocks, so the CUDA-only import branches are taken. Then: the engine core, GPU
worker and model runner, Llama, LoRA and attention modules import; the FlashAttention version
for sm_90; the engine config for the model with LoRA; and vLLM's own LoRA loader on PEFT adapters
(module names matched, B non-zero). Nothing CUDA runs. The environment (docs/gpu.md#vllm-on-the-lent-gpu):
  python3 -m venv V; V/bin/pip install --no-deps <torch CPU> <the image's packages vLLM touches> <the carried wheels>
  tar -C TREE -xJf .dev/vllm/vllm-0.25.0-trimmed.tar.xz
  VLLM_TREE=TREE PYTHONPATH=TREE:benchmarks/lent_gpu/stub_vllm VLLM_USE_FLASHINFER_SAMPLER=0 \\
    V/bin/python benchmarks/lent_gpu/vllm_cpu_check.py MODEL_DIR [ADAPTER_DIR ...]
"""

import glob
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from unittest import mock

EXTENSIONS = ["vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._qutlass_C",
              "vllm._flashmla_C", "vllm._flashmla_extension_C", "vllm.cumem_allocator", "vllm.fs_io_C",
              "vllm.spinloop", "vllm._rust_tool_parser", "vllm.vllm_flash_attn._vllm_fa2_C",
              "vllm.vllm_flash_attn._vllm_fa3_C"]
PATH_MODULES = ["vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
                "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama",
                "vllm.model_executor.model_loader", "vllm.lora.worker_manager", "vllm.lora.model_manager",
                "vllm.lora.layers", "vllm.lora.punica_wrapper.punica_gpu", "vllm.lora.ops.triton_ops",
                "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
                "vllm.v1.sample.ops.topk_topp_sampler", "vllm.compilation.backends", "vllm.v1.structured_output"]
imported, absent = [], []


class Extensions(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A dummy module for each compiled extension the tree ships; the others are left to fail."""

    def find_spec(self, name, path, target=None):
        if name not in EXTENSIONS:
            return None
        if not glob.glob(os.path.join(os.environ["VLLM_TREE"], *name.split(".")) + ".*so"):
            absent.append(name)
            return None
        imported.append(name)
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


def fake_hopper() -> None:
    import torch._ops
    import torch.library

    sys.meta_path.insert(0, Extensions())
    op_getattr = torch._ops._OpNamespace.__getattr__

    def getattr_(self, name):  # vLLM's ops namespaces answer any name; torch's own stay real
        try:
            return op_getattr(self, name)
        except (AttributeError, RuntimeError):
            if name.startswith("__") or not self.name.startswith(("_C", "_moe_C", "_qutlass_C", "_vllm_")):
                raise
            return mock.MagicMock(name=f"torch.ops.{self.name}.{name}")

    register_fake = torch.library.register_fake

    def register_fake_(op, fn=None, **kw):
        def deco(f):
            try:
                return register_fake(op, **kw)(f)
            except RuntimeError:  # the op lives in an extension that cannot load here
                return f
        return deco if fn is None else deco(fn)

    torch._ops._OpNamespace.__getattr__ = getattr_
    torch.library.register_fake = register_fake_
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # no accelerator to pin for
    import vllm.platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    platform = cuda.CudaPlatform()
    type(platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    type(platform).get_device_name = classmethod(lambda cls, device_id=0: "NVIDIA H100 80GB HBM3")
    vllm.platforms.current_platform = platform


def check(model: str, adapters: list[str]) -> None:
    import torch

    for name in PATH_MODULES:
        importlib.import_module(name)
    print(f"imported: {len(PATH_MODULES)} modules of the offline LoRA path")
    print("extensions imported:", sorted(set(imported)), "tried and absent:", sorted(set(absent)))
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    print("FlashAttention version on sm_90, head size 64:", get_flash_attn_version(head_size=64))
    from vllm.engine.arg_utils import EngineArgs

    # the sampler's own arguments (sampling/vllm.py from_config, colocated on cuda:0) less sleep mode,
    # whose allocator needs CUDA
    cfg = EngineArgs(model=model, tokenizer=model, enable_lora=True, max_lora_rank=32, max_loras=2,
                     enable_prefix_caching=True, gpu_memory_utilization=0.5, max_model_len=None, dtype="bfloat16",
                     seed=0, trust_remote_code=False, logprobs_mode="raw_logprobs", device_ids=[0]).create_engine_config()
    print("engine config:", cfg.model_config.architectures, "max_model_len", cfg.model_config.max_model_len,
          "max_lora_rank", cfg.lora_config.max_lora_rank, "logprobs_mode", cfg.model_config.logprobs_mode)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    SamplingParams(temperature=0.7, top_p=1.0, max_tokens=32, seed=3, logprobs=0, stop_token_ids=[2],
                   skip_special_tokens=True, detokenize=False)
    TokensPrompt(prompt_token_ids=[1, 2, 3])
    LoRARequest(lora_name="v1.1", lora_int_id=1, lora_path="/tmp/adapter")
    print("the sampler's SamplingParams, TokensPrompt and LoRARequest construct")
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models.llama import LlamaForCausalLM

    packed = LlamaForCausalLM.packed_modules_mapping  # as the worker builds the expected names
    expected = {m for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for m in packed.get(s, [s])}
    for path in adapters:
        helper = PEFTHelper.from_local_dir(path, max_position_embeddings=cfg.model_config.max_model_len)
        helper.validate_legal(LoRAConfig(max_lora_rank=32, max_loras=2))
        lora = LoRAModel.from_local_checkpoint(path, expected, helper, lora_model_id=1, device="cpu", dtype=torch.bfloat16,
                                               model_vocab_size=cfg.model_config.get_vocab_size(),
                                               weights_mapper=LlamaForCausalLM.hf_to_vllm_mapper.get_unstacked_mapper())
        nonzero = sum(bool(m.lora_b.any()) for m in lora.loras.values())
        print(f"adapter {path}: rank {helper.r}, {len(lora.loras)} modules, {nonzero} with non-zero B")


if __name__ == "__main__":
    if len(sys.argv) < 2 or "VLLM_TREE" not in os.environ:
        sys.exit(__doc__)
    fake_hopper()
    check(sys.argv[1], sys.argv[2:])
