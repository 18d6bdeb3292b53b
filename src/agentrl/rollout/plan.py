"""The plan before a run: how much KV cache a run's trajectories are expected to need, checked
against the hf sampler's budget before anything is written. It renders a typical opening prompt
(env, prompt) and reads the model's config (models), so it sits above the sampling layer."""

from __future__ import annotations

from agentrl.env import prompt_messages
from agentrl.errors import UserError
from agentrl.models import load_tokenizer, pick_device, pick_dtype, resolve_model
from agentrl.prompt import ChatRenderer
from agentrl.sampling.budget import gb, kv_budget_bytes
from agentrl.sampling.compat import kv_bytes_per_token

# Tokens a rollout step adds (the reply and the next observation), by sampling.action_space. The
# KV store's capacity is its longest row's, so the estimate is the longest row's, not the mean's.
# Free text: ~400 tokens at step 1, ~1.9k at step 30 with the default model; the longest of 61
# greedy valid_unseen rows fit in 2,048 at T_max 30 (56 per step: 2,201). Admissible actions: every
# command is valid, so every step brings a real observation instead of "Nothing happens.": the
# store's capacity reached 2,944 tokens on 73 valid_unseen rows and 2,304 on 61 at T_max 30
# (2026-11-27, docs/measurements/action-space.md), and about 3,100 on 75 valid_seen rows (read from
# the process's peak RSS), where the free-text estimate says 2,201; 88 per step plans 3,161.
TOKENS_PER_STEP = {"free": 56, "admissible": 88}

# an ALFWorld opening of typical length (a kitchen), for estimates made before any game is loaded
TYPICAL_FIRST_OBSERVATION = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 6, a cabinet 5, a cabinet 4, "
    "a cabinet 3, a cabinet 2, a cabinet 1, a coffeemachine 1, a countertop 3, a countertop 2, a countertop 1, "
    "a drawer 3, a drawer 2, a drawer 1, a fridge 1, a garbagecan 1, a microwave 1, a sinkbasin 1, a stoveburner 4, "
    "a stoveburner 3, a stoveburner 2, a stoveburner 1, and a toaster 1.\n\nYour task is to: put a clean mug in "
    "coffeemachine.")


def expected_context_tokens(cfg, max_steps: int, tokenizer) -> int:
    """Tokens one trajectory is expected to hold at its end: the rendered opening prompt (the run's
    prompt settings, a typical first observation) plus TOKENS_PER_STEP (of the run's action space)
    per step and one reply's room."""
    messages = prompt_messages(cfg.env.kind, cfg.prompt)("pick_and_place_simple", TYPICAL_FIRST_OBSERVATION, cfg.prompt.dir)
    opening = len(ChatRenderer(tokenizer).initial(messages))
    return opening + TOKENS_PER_STEP[cfg.sampling.action_space] * max_steps + cfg.sampling.max_new_tokens


def check_kv_fits(cfg, rows: int, max_steps: int, what: str) -> None:
    """Refuse, with one line and before anything is written, a run of `rows` trajectories stepped
    together whose expected KV cache exceeds the budget (hf sampler only: vLLM manages its own)."""
    if cfg.sampling.backend != "hf" or rows <= 0 or cfg.env.kind != "alfworld":
        return
    import torch  # torch, transformers: not at import (the CLI imports this module via evaluate)
    from transformers import AutoConfig

    path = resolve_model(cfg.model.name)
    device = torch.device(pick_device(cfg.model.device))
    model_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    per_token = kv_bytes_per_token(model_config, pick_dtype(cfg.model.dtype, str(device)))
    tokens = expected_context_tokens(cfg, max_steps, load_tokenizer(cfg.model.name, cfg.model.trust_remote_code))
    need = rows * tokens * per_token
    budget = kv_budget_bytes(cfg.sampling.kv_budget_gb, device)
    if need > budget:
        raise UserError(f"{what}: {rows} {'trajectory' if rows == 1 else 'trajectories'} x ~{tokens} tokens need ~{gb(need)} GB of KV cache, over "
                        f"sampling.kv_budget_gb={'auto: ' if cfg.sampling.kv_budget_gb == 'auto' else ''}{gb(budget)} GB; "
                        + ("step fewer trajectories together (rollout.tasks x rollout.group_size"
                           + (", or more --rounds" if what == "rollout" else "") + "), " if rows > 1 else "")
                        + "lower env.max_steps, or raise sampling.kv_budget_gb")
