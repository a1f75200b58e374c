"""The text of one JSONL record or Arrow row: the ``--field`` paths given (dotted, e.g. ``response`` or
``data.text`` or ``turns.0``; several fields are joined by a blank line), or else, by default, its chat
``messages`` / ``conversations`` list (the contents joined), else its ``text`` string, else all of its top-level
string values joined by newlines. Chat contents may be strings, ``{"content"|"value": ...}`` dicts or lists of
``{"type": "text", "text": ...}`` parts, the shapes the common chat datasets use."""

from __future__ import annotations

from typing import Any, Sequence


def _chat_text(messages: Sequence[Any]) -> str | None:
    """The contents of a chat's turns, one a line (turns without text left out)."""
    parts = []
    for m in messages:
        if isinstance(m, str):
            parts.append(m)
            continue
        if not isinstance(m, dict):
            continue
        content = m.get("content", m.get("value", m.get("text")))
        text = _as_text(content)
        if text:
            parts.append(text)
    return "\n".join(parts) if parts else None


def _as_text(value: Any) -> str | None:
    """A field's value as text: strings as they are, numbers written out, chats and lists joined by lines."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, dict):
        if "content" in value or "value" in value:
            return _as_text(value.get("content", value.get("value")))
        if value.get("type") == "text" and "text" in value:
            return _as_text(value["text"])
        return None
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, dict) for v in value):
            return _chat_text(value)
        parts = [t for t in (_as_text(v) for v in value) if t]
        return "\n".join(parts) if parts else None
    return None


def _get_path(record: Any, path: Sequence[str]) -> Any:
    """The value at a dotted path split in parts (list items by index, negative ones too); ``None`` if absent."""
    value = record
    for part in path:
        if isinstance(value, dict):
            if part not in value:
                return None
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
            i = int(part)
            if not -len(value) <= i < len(value):
                return None
            value = value[i]
        else:
            return None
    return value


def extract_text(record: Any, fields: Sequence[str] | None = None) -> str | None:
    """The text of one record (see the module docstring); ``None`` when it has none."""
    if fields:
        parts = [_as_text(_get_path(record, f.split("."))) for f in fields]
        parts = [p for p in parts if p]
        return "\n\n".join(parts) if parts else None
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return _as_text(record)
    for key in ("messages", "conversations", "conversation"):
        if isinstance(record.get(key), list):
            return _chat_text(record[key])
    if isinstance(record.get("text"), str):
        return record["text"]
    parts = [v for v in record.values() if isinstance(v, str) and v]
    return "\n".join(parts) if parts else None
