from agentrl.env.actions import map_action, parse_action

ADMISSIBLE = ["go to cabinet 1", "go to cabinet 11", "take mug 1 from countertop 1", "open fridge 1", "look", "inventory"]


def test_parse_action_takes_the_first_action_line():
    text = "Thought: I need a mug.\nAction: take mug 1 from countertop 1\nObservation: hallucinated"
    assert parse_action(text) == "take mug 1 from countertop 1"


def test_parse_action_normalises_case_space_quotes_and_period():
    assert parse_action("Thought: x\naction:   Go  To Cabinet 1.  ") == "go to cabinet 1"
    assert parse_action('Action: "open fridge 1"') == "open fridge 1"
    assert parse_action("Thought: go\nACTION : `look`") == "look"


def test_parse_action_without_action_is_none():
    assert parse_action("Thought: I am thinking only.") is None
    assert parse_action("") is None
    assert parse_action("Action:   \nmore") is None


def test_map_action_exact_and_normalised():
    assert map_action("go to cabinet 1", ADMISSIBLE, 85) == ("go to cabinet 1", 100.0)
    assert map_action("GO TO cabinet 11", ADMISSIBLE, 85) == ("go to cabinet 11", 100.0)


def test_map_action_fuzzy_above_threshold():
    command, score = map_action("take mug 1 from the countertop 1", ADMISSIBLE, 85)
    assert command == "take mug 1 from countertop 1"
    assert 85 <= score < 100


def test_map_action_below_threshold_is_invalid():
    command, score = map_action("jump on the table", ADMISSIBLE, 85)
    assert command is None and score < 85
    assert map_action(None, ADMISSIBLE, 85) == (None, 0.0)
    assert map_action("look", [], 85) == (None, 0.0)


def test_map_action_threshold_is_respected():
    # "go to cabinet 2" is close to "go to cabinet 1" (ratio ~93): valid at 85, invalid at 99
    assert map_action("go to cabinet 2", ADMISSIBLE, 85)[0] in ("go to cabinet 1", "go to cabinet 11")
    assert map_action("go to cabinet 2", ADMISSIBLE, 99)[0] is None
