"""Values copied from the prompt into a JSON string, drafted as the tokenizer writes them there.

An extracted value is the prompt's text, but not its tokens: SmolLM2 reads ``from Cork`` as ``' Cork'`` and
writes ``"city": "Cork"`` as ``'C', 'ork'`` (after a quote a word has no leading space), so a lookup that matches
token ids never finds the value. This source matches TEXT instead: the string begun since the last quote is
looked up in the prompt's text, and the rest of the prompt's word or phrase, with the closing quote, is tokenized
in the string's own context (the text from the quote's token on, encoded whole), so the draft holds the tokens
the model would write. A draft: a wrong guess costs rows, never a token."""

from __future__ import annotations

from typing import Any, Sequence

COPIED = "copied"  # the source name of the nodes this drafts (Stats.accepted counts them under it)
LOOKBACK = 16  # output tokens searched back for the string's opening quote
ENDS = ',.;:!?()[]{}"\n'  # where a copied value is taken to end in the prompt's text
LONGEST = 32  # characters a copied continuation may run to


class CopiedValues:
    """The prompt's text, and the tokenizer (a transformers tokenizer: ``encode``, ``decode``) that writes the
    string: ``propose(output)`` is the texts continuing the string ``output`` ends inside (none, or the rest of
    the prompt's word and of its phrase, each closed by the quote: where the value ends is the model's choice),
    ``tokens`` one of them (with what the grammar forces after it) as the model would write it there."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.prompt = tokenizer.decode(list(prompt)) if prompt else ""

    def propose(self, output: Sequence[int]) -> list[str]:
        """The texts that may close the string ``output`` ends inside, the quote included."""
        opened = self._opening(output)
        if opened is None:
            return []
        written = self.tokenizer.decode(list(output[opened:]))
        phrase = self._continuation(written[written.rindex('"') + 1:])
        if phrase is None:
            return []
        return [rest + '"' for rest in dict.fromkeys([phrase, phrase.split(" ")[0]])]  # the phrase, its word

    def tokens(self, output: Sequence[int], text: str) -> list[int]:
        """``text`` after ``output`` as the tokenizer writes it there: the string from its quote's token on,
        encoded whole, less the tokens already written (or ``text`` alone, where they would merge otherwise)."""
        opened = self._opening(output)
        tail = list(output[opened:]) if opened is not None else []
        whole = self.tokenizer.encode(self.tokenizer.decode(tail) + text, add_special_tokens=False)
        if whole[: len(tail)] == tail and len(whole) > len(tail):
            return whole[len(tail):]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _opening(self, output: Sequence[int]) -> int | None:
        """Where the token holding the string's opening quote starts, when the string begun after it is some
        text (an empty one could be any of the prompt's words: no guess)."""
        for start in range(len(output) - 1, max(len(output) - LOOKBACK, 0) - 1, -1):
            text = self.tokenizer.decode(list(output[start:]))
            if '"' in text:
                begun = text[text.rindex('"') + 1:]
                return start if begun.strip() and begun[0].isalnum() else None
        return None

    def _continuation(self, begun: str) -> str | None:
        """The prompt's text after its last copy of ``begun`` that starts a word, up to where a value ends."""
        at = len(self.prompt)
        while (at := self.prompt.rfind(begun, 0, at)) >= 0:
            if at == 0 or not self.prompt[at - 1].isalnum():
                after = self.prompt[at + len(begun): at + len(begun) + LONGEST]
                cut = next((i for i, c in enumerate(after) if c in ENDS), len(after))
                return after[:cut]
        return None
