"""ReAct prompt and chat rendering to exact token ids.

The system message is prompts/system.txt (`prompt.reply: react`, replies `Thought: ...` /
`Action: ...`) or prompts/system_action.txt (`prompt.reply: action`, replies `Action: ...`
only: what a policy warm-started on expert walkthroughs, which carry no thoughts, was taught).
With `prompt.example: type` (the default) the in-context example of the game's task type
(prompts/examples/<task_type>.txt, a real train walkthrough) follows as chat turns: each of
its observations a user turn, each Thought/Action an assistant turn; small models follow
the format far better this way than with the example pasted into the system message. Then
the episode: its first observation is a user turn, each reply `Thought: ...` /
`Action: ...`, each later observation a user turn. `prompt.example: none` leaves the example out:
it doubles every prompt, and a policy trained on hundreds of demonstrations does not need it.

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
SYSTEM_FILES = {"react": "system.txt", "action": "system_action.txt"}


def default_prompt_dir() -> Path:
    """The prompts/ folder beside src/ (editable install / source checkout)."""
    return Path(__file__).resolve().parents[2] / "prompts"


@lru_cache(maxsize=8)
def load_prompts(prompt_dir: str | None = None, reply: str = "react") -> tuple[str, dict[str, tuple[tuple[str, str], ...]]]:
    """(system text, {task_type: ((observation, reply), ...)}); a clear error for a missing file.
    With reply="action" the examples' replies keep only their Action line."""
    d = Path(prompt_dir) if prompt_dir else default_prompt_dir()
    system_file = d / SYSTEM_FILES[reply]
    if not system_file.is_file():
        raise UserError(f"prompt file not found: {system_file}")
    examples = {}
    for t in TASK_TYPES:
        f = d / "examples" / f"{t}.txt"
        if not f.is_file():
            raise UserError(f"in-context example not found: {f}")
        examples[t] = parse_example(f)
        if reply == "action":
            examples[t] = tuple((obs, action_reply(r)) for obs, r in examples[t])
    return system_file.read_text().strip(), examples


def action_reply(reply: str) -> str:
    """The `Action: ...` line of a Thought/Action reply."""
    return next(line for line in reply.splitlines() if line.startswith("Action: "))


def parse_example(path: Path) -> tuple[tuple[str, str], ...]:
    """Observation/Thought/Action lines -> ((observation, "Thought: ...\nAction: ..."), ...)."""
    turns: list[list[str]] = []
    for line in path.read_text().splitlines():
        if line.startswith("Observation: "):
            turns.append([line[len("Observation: ") :], ""])
        elif line.startswith(("Thought: ", "Action: ")) and turns:
            turns[-1][1] = (turns[-1][1] + "\n" + line).strip()
        elif line.strip() and not line.startswith("#"):
            raise UserError(f"{path}: unexpected line {line[:60]!r} (want Observation:/Thought:/Action:)")
    pairs = tuple((obs, reply) for obs, reply in turns if reply)  # the final observation has no reply
    if not pairs:
        raise UserError(f"{path}: no Observation/Thought/Action turns")
    return pairs


def episode_messages(task_type: str, first_observation: str, prompt_dir: str | None = None, example: str = "type",
                     reply: str = "react") -> list[dict]:
    """System message, the task type's example as chat turns (unless example="none"), then the
    episode's first observation."""
    system, examples = load_prompts(prompt_dir, reply)
    messages = [{"role": "system", "content": system}]
    for obs, answer in (examples[task_type] if example == "type" else ()):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": first_observation}]


def with_admissible(observation: str, commands: list[str]) -> str:
    """`prompt.admissible`: the observation followed by the commands the game accepts now (the
    field's ALFWorld prompt, verl-agent's, lists them too); a reply naming one is always valid."""
    return f"{observation}\nAdmissible actions: {', '.join(commands)}." if commands else observation


def reply_text(command: str, reply: str) -> str:
    """The reply that teaches `command` in the given format (what parse_action reads back)."""
    if reply == "action":
        return f"Action: {command}"
    raise UserError("expert replies exist only for prompt.reply 'action': walkthroughs carry no thoughts")


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

    @property
    def end_of_turn_ids(self) -> list[int]:
        """Ids of the end-of-turn token a sampler stops on (written after a reply), [] if none."""
        return self.encode(self._eos_text) if self._eos_text else []

    def command_reply(self, command: str) -> list[int]:
        """The ids of the reply that is `command` (`Action: <command>`, then the end-of-turn token):
        what the warm start teaches, and what the admissible action space lets a reply be."""
        return self.encode(reply_text(command, "action")) + self.end_of_turn_ids

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def initial(self, messages: list[dict]) -> list[int]:
        """Ids of the opening messages (ending with a user turn) and the assistant header."""
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
