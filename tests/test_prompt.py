import pytest

from agentrl.config import TASK_TYPES
from agentrl.errors import UserError
from agentrl.prompt import ChatRenderer, episode_messages, load_prompts


def test_every_task_type_has_a_real_example():
    system, examples = load_prompts()
    assert "Thought:" in system and "Action:" in system
    for t in TASK_TYPES:
        turns = examples[t]
        assert len(turns) >= 2
        for obs, reply in turns:
            assert obs and not obs.startswith("Observation:")
            assert reply.startswith("Thought: ") and "\nAction: " in reply and "TODO" not in reply


def test_episode_messages_use_the_matching_example_as_turns():
    _, examples = load_prompts()
    msgs = episode_messages("pick_cool_then_place_in_recep", "FIRST OBS")
    turns = examples["pick_cool_then_place_in_recep"]
    assert msgs[0]["role"] == "system"
    assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * len(turns) + ["user"]
    assert msgs[1]["content"] == turns[0][0] and msgs[2]["content"] == turns[0][1]
    assert msgs[-1] == {"role": "user", "content": "FIRST OBS"}


def test_missing_prompt_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="prompt file not found"):
        load_prompts(str(tmp_path))


def test_malformed_example_is_a_user_error(tmp_path):
    (tmp_path / "system.txt").write_text("sys")
    (tmp_path / "examples").mkdir()
    for t in TASK_TYPES:
        (tmp_path / "examples" / f"{t}.txt").write_text("Observation: o\nThought: t\nAction: look\nObservation: o2\n")
    (tmp_path / "examples" / "look_at_obj_in_light.txt").write_text("Observation: o\nsomething else\n")
    with pytest.raises(UserError, match="unexpected line 'something else'"):
        load_prompts(str(tmp_path))


def full_text(tokenizer, system, turns, generation_prompt=True):
    messages = [{"role": "system", "content": system}]
    for role, content in turns:
        messages.append({"role": role, "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_incremental_ids_render_the_same_chat_as_the_template(tokenizer):
    """prompt + reply(with stop token) + observation ids decode to exactly the template's text."""
    r = ChatRenderer(tokenizer)
    ids = r.initial([{"role": "system", "content": "SYS"}, {"role": "user", "content": "obs one"}])
    assert tokenizer.decode(ids) == full_text(tokenizer, "SYS", [("user", "obs one")])
    reply = r.encode("Thought: t\nAction: look") + [tokenizer.eos_token_id]
    ids = ids + reply + r.observation("obs two", reply_stopped=True)
    expected = full_text(tokenizer, "SYS", [("user", "obs one"), ("assistant", "Thought: t\nAction: look"), ("user", "obs two")])
    assert tokenizer.decode(ids) == expected


def test_a_reply_cut_at_max_tokens_is_closed(tokenizer):
    r = ChatRenderer(tokenizer)
    ids = r.initial([{"role": "system", "content": "SYS"}, {"role": "user", "content": "obs one"}]) + r.encode("Thought: t") + r.observation("obs two", reply_stopped=False)
    expected = full_text(tokenizer, "SYS", [("user", "obs one"), ("assistant", "Thought: t"), ("user", "obs two")])
    assert tokenizer.decode(ids) == expected
