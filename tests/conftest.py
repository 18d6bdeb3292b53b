"""Shared fixtures: real ALFWorld games from ../shared, the prepared default model's tokenizer,
and a tiny randomly initialised Llama built from a config (fast unit tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _threads_per_worker() -> None:
    """Under pytest-xdist (`make test`: TEST_WORKERS), each worker's torch, and the CLI subprocesses
    its tests start, run on an equal share of the cores: otherwise every worker starts a thread per
    core and the workers oversubscribe them. Set before anything imports torch (agentrl.cluster
    does not); a thread count the user set is kept."""
    from agentrl.cluster import available_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, available_cores() // workers))


_threads_per_worker()


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


def random_llama(tokenizer, hidden: int, heads: int, kv_heads: int):
    """A 2-layer random Llama (seed 0) with the default model's vocabulary and special tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer random Llama with the default model's vocabulary and chat template."""
    return random_llama(tokenizer, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def head64_model(tokenizer):
    """A 2-layer random Llama of head size 64 (2 query heads on 1 KV head): what agentrl's CPU
    attention kernel's prefill and learner paths take (the tiny Llama's head size 16 they leave to SDPA)."""
    return random_llama(tokenizer, hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def games(data_root):
    """One real valid_seen game per task type."""
    from agentrl.config import TASK_TYPES
    from agentrl.env.data import discover_games

    return {t: discover_games("valid_seen", data_root, [t], limit=1)[0] for t in TASK_TYPES}


@pytest.fixture(scope="session")
def tiny_actor_dir(tmp_path_factory, tiny_model, tokenizer):
    """The tiny Llama after a few seconds of supervised training on the reply template
    `Action: move <random object> 1 to <random receptacle> 1`, saved as an ordinary HF model
    directory (config, safetensors, tokenizer). Sampled at temperature 1 it names random
    objects and receptacles; with env.fuzzy_threshold 0 each reply maps to the closest of the
    synthetic task's four commands, so groups have reward variance and GRPO updates are real
    (a random 2-layer model would never produce an `Action:` line)."""
    import copy
    import random

    import torch

    from agentrl.env.synthetic import OBJECTS, RECEPTACLES, SyntheticEnv, synthetic_games, synthetic_messages
    from agentrl.prompt import ChatRenderer

    torch.manual_seed(0)
    rng = random.Random(0)
    model = copy.deepcopy(tiny_model).train()
    renderer = ChatRenderer(tokenizer)
    game = synthetic_games("train", 1)[0]
    prompt = renderer.initial(synthetic_messages(game.task_type, SyntheticEnv(game).reset().observation))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        replies = [renderer.encode(f"Action: move {rng.choice(OBJECTS)} 1 to {rng.choice(RECEPTACLES)} 1<|im_end|>")
                   for _ in range(8)]
        width = max(map(len, replies))
        ids = torch.tensor([prompt + r + [0] * (width - len(r)) for r in replies])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in replies])
        logits = model(input_ids=ids, logits_to_keep=width + 1).logits[:, :-1]  # only the reply positions
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("tiny-actor")
    model.eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
