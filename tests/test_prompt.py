import pytest

from agentrl.config import TASK_TYPES
from agentrl.errors import UserError
from agentrl.prompt import ChatRenderer, load_prompts, system_message


def test_every_task_type_has_a_real_example():
    system, examples = load_prompts()
    assert "{example}" in system
    for t in TASK_TYPES:
        ex = examples[t]
        assert "Observation:" in ex and "Thought:" in ex and "Action:" in ex
        assert "TODO" not in ex


def test_system_message_inserts_the_matching_example():
    _, examples = load_prompts()
    msg = system_message("pick_cool_then_place_in_recep")
    assert examples["pick_cool_then_place_in_recep"] in msg and "{example}" not in msg
    assert examples["look_at_obj_in_light"] not in msg


def test_missing_prompt_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="prompt file not found"):
        load_prompts(str(tmp_path))


def full_text(tokenizer, system, turns, generation_prompt=True):
    messages = [{"role": "system", "content": system}]
    for role, content in turns:
        messages.append({"role": role, "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_incremental_ids_render_the_same_chat_as_the_template(tokenizer):
    """prompt + reply(with stop token) + observation ids decode to exactly the template's text."""
    r = ChatRenderer(tokenizer)
    ids = r.initial("SYS", "obs one")
    assert tokenizer.decode(ids) == full_text(tokenizer, "SYS", [("user", "obs one")])
    reply = r.encode("Thought: t\nAction: look") + [tokenizer.eos_token_id]
    ids = ids + reply + r.observation("obs two", reply_stopped=True)
    expected = full_text(tokenizer, "SYS", [("user", "obs one"), ("assistant", "Thought: t\nAction: look"), ("user", "obs two")])
    assert tokenizer.decode(ids) == expected


def test_a_reply_cut_at_max_tokens_is_closed(tokenizer):
    r = ChatRenderer(tokenizer)
    ids = r.initial("SYS", "obs one") + r.encode("Thought: t") + r.observation("obs two", reply_stopped=False)
    expected = full_text(tokenizer, "SYS", [("user", "obs one"), ("assistant", "Thought: t"), ("user", "obs two")])
    assert tokenizer.decode(ids) == expected
