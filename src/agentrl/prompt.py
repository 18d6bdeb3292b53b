"""ReAct prompt and chat rendering to exact token ids.

The system message is prompts/system.txt with `{example}` replaced by the in-context example
of the game's task type (prompts/examples/<task_type>.txt, taken from a real walkthrough).
The first observation is the first user message; each reply is `Thought: ...` /
`Action: ...`; each later observation is a user message.

Token ids grow by appending: [prompt] + generated + [end of turn, observation, assistant
header] + generated + ... The ids the sampler produced are kept as they are (never
re-tokenised), so the learner trains on exactly what was sampled.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from agentrl.config import TASK_TYPES
from agentrl.errors import UserError

_SENTINEL = "\x00AGENTRL_TURN\x00"


def default_prompt_dir() -> Path:
    """The prompts/ folder beside src/ (editable install / source checkout)."""
    return Path(__file__).resolve().parents[2] / "prompts"


@lru_cache(maxsize=8)
def load_prompts(prompt_dir: str | None = None) -> tuple[str, dict[str, str]]:
    """(system template, {task_type: example transcript}); a clear error for a missing file."""
    d = Path(prompt_dir) if prompt_dir else default_prompt_dir()
    system_file = d / "system.txt"
    if not system_file.is_file():
        raise UserError(f"prompt file not found: {system_file}")
    system = system_file.read_text()
    if system.count("{example}") != 1:
        raise UserError(f"{system_file} must contain the placeholder {{example}} exactly once")
    examples = {}
    for t in TASK_TYPES:
        f = d / "examples" / f"{t}.txt"
        if not f.is_file():
            raise UserError(f"in-context example not found: {f}")
        lines = [ln for ln in f.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        examples[t] = "\n".join(lines)
    return system, examples


def system_message(task_type: str, prompt_dir: str | None = None) -> str:
    system, examples = load_prompts(prompt_dir)
    return system.replace("{example}", examples[task_type]).strip()


class ChatRenderer:
    """Chat template -> token ids, incrementally. Works for any tokenizer with a chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token or ""
        # What the template writes between an assistant reply and the next user turn's header,
        # e.g. ChatML: "<|im_end|>\n<|im_start|>user\n". Measured once with a sentinel reply.
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        after = self._text(probe + [{"role": "user", "content": _SENTINEL}], generation_prompt=True)
        start = after.index(_SENTINEL) + len(_SENTINEL)
        between, _, header = after[start:].partition(_SENTINEL)
        self._turn_prefix, self._turn_suffix = between, header  # suffix: end of user turn + assistant header
        self._eos_text = eos if between.startswith(eos) and eos else ""

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def initial(self, system: str, observation: str) -> list[int]:
        """Ids of [system, first observation, assistant header]."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": observation}]
        return self.encode(self._text(messages, generation_prompt=True))

    def observation(self, observation: str, reply_stopped: bool) -> list[int]:
        """Ids that follow a generated reply: close the reply's turn, the observation, the next header.

        If the reply ended with the stop token (the end-of-turn token) it is already in the ids,
        so it is not written again; a reply cut at max_new_tokens is closed here.
        """
        prefix = self._turn_prefix
        if reply_stopped and self._eos_text:
            prefix = prefix[len(self._eos_text) :]
        return self.encode(prefix + observation + self._turn_suffix)
