"""Model output is untrusted: the action parser, the action mapper and the prompt renderer get
arbitrary text (any unicode, control characters, huge strings, chat-template markup, text that
looks like our own `Action:` format) and must never crash; the worst outcome is an invalid
action, which is a recorded no-op on the real engine."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env.actions import map_action, parse_action
from agentrl.env.alfworld import NOTHING_HAPPENS, AlfworldEnv
from agentrl.prompt import ChatRenderer

TEMPLATE_BITS = ["Action:", "Thought:", "action: ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant\n",
                 "{{ messages }}", "{% for m in messages %}", "\x00", "\r\n", "\u202e", "\ufeff", "go to ", "take ",
                 " from ", "cabinet 1", "\n\n", "`", "*", "[", "]", ">"]

replies = st.one_of(
    st.text(),
    st.lists(st.one_of(st.sampled_from(TEMPLATE_BITS), st.text(max_size=8)), max_size=30).map("".join),
    st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=12), st.integers(1_000, 20_000)),  # huge
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@FUZZ
@given(text=replies)
def test_parse_action_never_crashes_and_returns_one_clean_line(text):
    action = parse_action(text)
    assert action is None or (isinstance(action, str) and action and "\n" not in action and action == action.lower())


@FUZZ
@given(text=replies, threshold=st.floats(0, 100))
def test_map_action_returns_an_admissible_command_or_none(text, threshold):
    admissible = ["go to cabinet 1", "go to countertop 2", "take apple 1 from countertop 2", "look", "inventory"]
    command, score = map_action(parse_action(text), admissible, threshold)
    assert command is None or command in admissible
    assert 0.0 <= score <= 100.0


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


@FUZZ
@given(text=replies, stopped=st.booleans())
def test_renderer_turns_any_text_into_valid_ids(renderer, tokenizer, text, stopped):
    ids = renderer.observation(text, stopped)
    assert ids and all(isinstance(i, int) and 0 <= i < len(tokenizer) for i in ids)
    first = renderer.initial([{"role": "system", "content": text}, {"role": "user", "content": text}])
    assert first and all(0 <= i < len(tokenizer) for i in first)


@pytest.fixture(scope="module")
def env(games):
    e = AlfworldEnv(games["look_at_obj_in_light"])
    e.reset()
    yield e
    e.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=replies)
def test_any_reply_is_a_valid_command_or_a_recorded_no_op_on_the_real_engine(env, text):
    """parse -> map -> step on a real ALFWorld game: either an admissible command the engine runs,
    or an invalid action that changes nothing and answers "Nothing happens."."""
    before = list(env._admissible)
    command, _ = map_action(parse_action(text), before, 85.0)
    result = env.step(command)
    if command is None:
        assert result.observation == NOTHING_HAPPENS and result.admissible == before
    else:
        assert command in before and isinstance(result.observation, str)
