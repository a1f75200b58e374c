"""A model's chat template rendered with jinja2 as transformers renders it, without importing transformers.

What transformers does for ``apply_chat_template(messages, tokenize=False, ...)`` and what is reproduced here:
the template runs in jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` and the loop controls;
``tojson`` writes plain ``json.dumps`` (no HTML escaping, non-ASCII kept); ``raise_exception``, ``strftime_now``,
a ``dict`` builder and a ``namespace`` that refuses underscore names are globals; the messages lose their keys
whose value is None, reasoning given under ``thinking`` or ``reasoning`` is also passed as ``reasoning_content``,
and the template sees the named special tokens (``bos_token``, ``eos_token``, ...). A template that needs more
(transformers' ``{% generation %}`` tag) does not compile here: :func:`compile_template` says None, and the model's
tokenizer then loads through transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING = ("reasoning_content", "thinking", "reasoning")  # the names reasoning comes under; the first is read


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict(...)`` in a template, without the class itself (its attributes) in reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed names (CPython's internals stay out of reach)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick: ``namespace(self=...)`` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def compile_template(source: str) -> jinja2.Template | None:
    """``source`` compiled in transformers' environment, or None where it does not compile here."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                               namespace=_Namespace)
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError:
        return None


def plain(value: Any) -> Any:
    """``value`` rebuilt from JSON's types, as transformers hands a template its inputs (anything else becomes a
    placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):  # subclasses (enums, ...) back to the base type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return f"<{type(value).__name__}>"


def messages_for(messages: list[dict]) -> list[dict]:
    """The messages as a template sees them: keys whose value is None dropped, reasoning under every name."""
    shown = []
    for message in messages:
        message = plain({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[key] for key in REASONING if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        shown.append(message)
    return shown


def render(template: jinja2.Template, messages: list[dict], specials: dict[str, str],
           add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    """The conversation's text; ``specials``: the named special tokens (``bos_token``: ``<s>``, ...)."""
    return template.render(messages=messages_for(messages), tools=plain(tools), documents=None,
                           add_generation_prompt=add_generation_prompt, **specials)
