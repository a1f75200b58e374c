"""A generation's tokens as text: pieces held back inside a UTF-8 character or a possible stop string, and a
prompt or chat messages as the tokenizer's chat template takes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from graft_cli.core import GraftError

Prompt = str | list[dict]


@dataclass
class TextPieces:
    """Token steps to text: the tokens decoded whole each step (a token's text can depend on its neighbours), a
    piece held back while it ends inside a UTF-8 character or could be the beginning of a stop string, and the text
    cut before the first stop string."""

    tokenizer: Any
    stop_ids: set[int]
    stops: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the whole text so far, cut before a stop string
    given: int = 0  # how much of it has been given out
    stopped: bool = False

    def feed(self, new: Sequence[int]) -> str:
        self.ids.extend(t for t in new if t not in self.stop_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        self.stopped, self.text = cut >= 0, full[:cut] if cut >= 0 else full
        return self._give(len(self.text) - (0 if self.stopped else self._held(full)))

    def flush(self) -> str:
        """What was held back, once nothing more will come."""
        return self._give(len(self.text))

    def _held(self, full: str) -> int:
        """The longest end of ``full`` that a stop string begins with (it may yet complete the stop string)."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(full)), 0, -1)
                    if full.endswith(s[:n])), default=0)

    def _give(self, upto: int) -> str:
        piece = self.text[self.given : upto]
        self.given = max(self.given, upto)
        return piece


def chat_prompt(prompt: Prompt | None, messages: list[dict] | None, system: str | None, raw: bool) -> Prompt:
    """The prompt as ``encode`` takes it: text, or chat messages with the system prompt in front."""
    if (prompt is None) == (messages is None):
        raise GraftError("give a prompt or messages (one of them)")
    if system is not None and raw:
        raise GraftError("a system prompt needs the chat template (not raw)")
    if messages is None and isinstance(prompt, list):
        messages, prompt = prompt, None
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise GraftError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and (isinstance(m.get("content"), str) or m.get("tool_calls"))):  # a call: no text needed
                raise GraftError(f'messages[{i}] must be an object with "role" and "content" texts')
        return ([{"role": "system", "content": system}] if system is not None else []) + messages
    if not isinstance(prompt, str):
        raise GraftError(f"the prompt must be text, not {type(prompt).__name__}")
    if system is None:
        return prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
