"""Backslash escapes in command-line text, read as llama.cpp reads them: a shell passes ``--stop "\\n\\n"`` as a
backslash and an ``n``, and a user who types it means a blank line. ``\\n \\t \\r \\\\ \\' \\" \\0 \\a \\b \\f \\v`` and
``\\xHH`` become the character they name; a backslash before anything else stays as it is, so a Windows path or a
regular expression typed into a stop string is not mangled."""

from __future__ import annotations

import re

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0", "a": "\a", "b": "\b",
           "f": "\f", "v": "\v"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)


def unescape(text: str) -> str:
    """``text`` with its backslash escapes replaced by the characters they name (unknown escapes kept)."""

    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        if len(code) == 3:
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, match.group(0))

    return _ESCAPE.sub(one, text)
