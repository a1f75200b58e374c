"""A request's grammar and the tokenizer it is compiled against.

The engine is llguidance (docs/structured.md says why): a grammar is its Lark text, made from a JSON schema, the
JSON grammar or a regular expression, and checked against the target's tokenizer before any forward, so a bad
schema or pattern is one line of error, never a failure mid-generation."""

from __future__ import annotations

import json
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass
from typing import Any, Iterable

import llguidance

from graft_cli.core import GraftError

# JSON as models write it: ", " between items, ": " after keys, no other whitespace (a schema's "x-guidance"
# overrides it). Free whitespace would let a small model pad an answer without end, and fixed separators are
# forced tokens: free drafts.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KEPT = 64  # grammars kept compiled per model: a server's repeated schemas and tool lists compile once


@dataclass(frozen=True)
class Grammar:
    """What a request's text must match: ``lark`` is llguidance's grammar text, ``what`` names it in errors."""

    lark: str
    what: str

    def __post_init__(self) -> None:  # checked when made, before a model loads (the tokenizer's check is later)
        error = llguidance.LLMatcher.validate_grammar(self.lark, None)
        if error:
            raise GraftError(f"invalid {self.what}: {_first_line(error)}")


def json_schema(schema: dict | str) -> Grammar:
    """Text that is one JSON value valid under ``schema`` (a dict, or its JSON text); ``{}`` allows any JSON."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GraftError(f"invalid JSON schema: not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    if not isinstance(schema, dict):
        raise GraftError(f"invalid JSON schema: an object, not {type(schema).__name__}")
    try:
        lark = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GraftError(f"invalid JSON schema: {_first_line(str(e))}") from None
    return Grammar(lark, "JSON schema")


def any_json() -> Grammar:
    """Any JSON object (OpenAI's ``json_object``: an object, as its clients expect)."""
    return json_schema({"type": "object"})


def regex(pattern: str) -> Grammar:
    """Text that matches ``pattern`` whole (Rust regex syntax: no look-around, no backreferences)."""
    if not isinstance(pattern, str) or not pattern:
        raise GraftError("a regular expression must be non-empty text")
    return Grammar(llguidance.LLMatcher.grammar_from_regex(pattern), "regular expression")


class GrammarTokenizer:
    """The target's tokenizer as llguidance reads it, built once per loaded model (about a second for a large
    vocabulary): ``vocab`` is the model's embedding size (masks cover every id it can produce), and every stop
    token is an end of text the grammar may allow once it is complete."""

    def __init__(self, tokenizer: Any, vocab: int, stops: Iterable[int]) -> None:
        stops = sorted(stops)
        self.vocab, self.stops, self.text = vocab, frozenset(stops), tokenizer
        # the stop token drafted where the grammar allows nothing else: the tokenizer's own end of text first
        self.end = tokenizer.eos_token_id if tokenizer.eos_token_id in self.stops else (stops or [None])[0]
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # by grammar text, never fed
        self.inner = llguidance.LLTokenizer(_serialised(tokenizer), n_vocab=vocab,
                                            eos_token=stops or tokenizer.eos_token_id)

    def forced(self, matcher: llguidance.LLMatcher) -> list[int]:
        """The tokens a state forces, as a whole string, then the stop token where the grammar is done after them
        (``"}`` closing the object ends the answer: the stop drafted with it saves a step). llguidance's forced
        tokens stop where the next token is ambiguous (``": "`` may end in ``" "`` or ``' "'``); the forced
        bytes, tokenized as the model's tokenizer would, go on to their end. A draft, so a wrong last token costs
        a row, never a token."""
        tokens = self._forced_text(matcher)
        fed = matcher.try_consume_tokens(tokens)
        if fed == len(tokens) and matcher.is_stopped() and self.end is not None:
            tokens = [*tokens, self.end]
        matcher.rollback(fed)
        return tokens

    def _forced_text(self, matcher: llguidance.LLMatcher) -> list[int]:
        tokens = matcher.compute_ff_tokens()
        try:
            whole = self.text.encode(matcher.compute_ff_bytes().decode("utf-8"), add_special_tokens=False)
        except UnicodeDecodeError:  # forced bytes that end inside a character: the tokens alone
            return tokens
        return whole if len(whole) > len(tokens) and whole[: len(tokens)] == tokens else tokens

    def check(self, grammar: Grammar) -> None:
        """A grammar that cannot be compiled is a one-line GraftError (checked before any forward; compiled
        here, it is kept for the request's matcher)."""
        self.matcher(grammar)

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the text (errors are raised, not printed): a copy of one compiled for
        the same grammar before (the last :data:`KEPT` are kept), so a request compiles its grammar at most once
        and a repeated schema never again (compiling a tool list's grammar takes milliseconds, a copy 40 us)."""
        compiled = self._compiled.pop(grammar.lark, None)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.inner, grammar.lark, log_level=0)
            if compiled.is_error():
                raise GraftError(f"invalid {grammar.what}: {_first_line(compiled.get_error())}")
        self._compiled[grammar.lark] = compiled  # the most recent last
        if len(self._compiled) > KEPT:
            self._compiled.popitem(last=False)
        return compiled.deep_copy()


def _serialised(tokenizer: Any) -> str:
    """The Rust tokenizer's JSON (what llguidance reads), padding and truncation off; a transformers tokenizer and
    graft's light one (graft_cli/models/tokenizer.py) both carry it as ``backend_tokenizer``. Read here rather than
    through ``llguidance.hf``, which imports transformers and takes only transformers' class."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GraftError("structured output needs a fast tokenizer (a tokenizer.json)")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _first_line(message: str) -> str:
    """llguidance's messages carry a caret diagram below their first line: the line is what a user needs."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "unknown error"
    if first.startswith("at ") and ": " in first:  # "at 1(8): invalid regex ..." -> "invalid regex ..."
        first = first.split(": ", 1)[1]
    detail = next((line[len("error: "):] for line in lines if line.startswith("error: ")), "")
    return f"{first} ({detail})" if detail and detail not in first else first


def json_value(schema: dict) -> str:
    """A Lark expression for one JSON value valid under ``schema``, laid out as :func:`json_schema`'s: a part of
    a grammar built of several (a tool call in its tags, a call or an answer)."""
    laid_out = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    return f"%json {json.dumps(laid_out)}"


def tagged_json(schema: dict, before: str, after: str, what: str) -> Grammar:
    """One JSON value valid under ``schema`` between ``before`` and ``after``, Lark expressions (a special token
    as ``<tool_call>``, text quoted)."""
    return Grammar(f"start: {before} value {after}\nvalue: {json_value(schema)}", what)
