"""Shared fixtures: real ALFWorld games from ../shared, the prepared default model's tokenizer,
and a tiny randomly initialised Llama built from a config (fast unit tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _data_root() -> Path:
    env = os.environ.get("ALFWORLD_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data" / "alfworld"


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = _data_root()
    if not (root / "json_2.1.1" / "valid_seen").is_dir():
        pytest.fail(f"ALFWorld test data not found at {root}; set ALFWORLD_DATA (CI uses ../shared/data/alfworld)")
    return root


@pytest.fixture(autouse=True)
def _alfworld_data_env(monkeypatch, data_root):
    monkeypatch.setenv("ALFWORLD_DATA", str(data_root))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from agentrl.models import default_model_dir, is_prepared

    path = default_model_dir()
    if not is_prepared(path):
        pytest.fail(f"default model not prepared at {path}; run `agentrl model prepare` (make test does)")
    return path


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer random Llama with the default model's vocabulary and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def games(data_root):
    """One real valid_seen game per task type."""
    from agentrl.config import TASK_TYPES
    from agentrl.env.data import discover_games

    return {t: discover_games("valid_seen", data_root, [t], limit=1)[0] for t in TASK_TYPES}
