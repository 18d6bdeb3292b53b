"""Model output -> environment command. The model's text is untrusted: never raise.

Response format: `Thought: ...` then `Action: <action>`. The action is the rest of the first
`Action:` line. It is mapped to an admissible command: exact, then case/space-insensitive,
then the best rapidfuzz ratio at or above the threshold. Anything else is invalid (None).
"""

from __future__ import annotations

import re

from rapidfuzz import fuzz, process

_ACTION = re.compile(r"action[ \t]*:[ \t]*(.*)", re.IGNORECASE)
_SPACES = re.compile(r"\s+")
_EDGE = " \t\"'`*>.[]"


def normalise(command: str) -> str:
    return _SPACES.sub(" ", command).strip(_EDGE).lower()


def parse_action(text: str) -> str | None:
    """The action string of a `Thought: ... Action: ...` response, or None if there is none."""
    match = _ACTION.search(text or "")
    if not match:
        return None
    line = match.group(1).split("\n", 1)[0]
    action = normalise(line)
    return action or None


def map_action(action: str | None, admissible: list[str], threshold: float) -> tuple[str | None, float]:
    """(admissible command, score 0-100) for a parsed action; (None, best score) below threshold."""
    if not action or not admissible:
        return None, 0.0
    if action in admissible:
        return action, 100.0
    action = normalise(action)
    by_norm = {normalise(c): c for c in admissible}
    if action in by_norm:
        return by_norm[action], 100.0
    best = process.extractOne(action, list(by_norm), scorer=fuzz.ratio)
    if best is None:
        return None, 0.0
    choice, score, _ = best
    return (by_norm[choice], float(score)) if score >= threshold else (None, float(score))
