"""Tool calls and structured answers as OpenAI's API asks for them: ``tools``, ``tool_choice`` and
``response_format`` checked into a grammar and the tools a chat template renders; an answer parsed back into
``tool_calls``.

A tool call is written the way the model's chat template asks for it: Hermes' tags (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, Qwen2.5's), else one bare JSON object. ``tool_choice: "required"`` or a named
function constrains the answer to such calls (in tags, one or several one after another unless
``parallel_tool_calls`` is false) whose arguments follow the function's schema; ``"auto"`` leaves the model free and
parses what it wrote, or with a ``response_format`` holds it to calls or that format; ``"none"`` leaves the tools out
of the prompt."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from graft_cli.core import GraftError
from graft_cli.grammar import Grammar, json_schema, json_value

OPEN = "<tool_call>\n"  # Hermes' tags, as Qwen2.5's template writes them (special tokens of its tokenizer)
TAGS = ('<tool_call> "\\n"', '"\\n" </tool_call>')  # the same in a grammar: the tokens, and the newlines
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class Refused(Exception):
    """A request's tools or response format that cannot be served: its message and the parameter (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI function objects) and its ``tool_choice``: "auto", "required" or a name.
    ``parallel``: an answer may hold several calls (OpenAI's ``parallel_tool_calls``, on by default; in Hermes'
    tags only, one after another: a bare JSON call is one)."""

    functions: tuple[dict, ...]
    choice: str
    tagged: bool = True  # calls in Hermes' tags (the template asks for them), else one bare JSON object
    parallel: bool = True

    def rendered(self) -> list[dict]:
        """The tools as a chat template takes them (``apply_chat_template(tools=...)``)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def grammar(self, answer: dict | None = None) -> Grammar | None:
        """The answer's grammar: calls of the chosen function (or of any, "required"); for "auto", None, or with
        ``answer`` (a response format's schema) calls of any function or that answer, as the model chooses."""
        if self.choice == "auto" and answer is None:
            return None
        chosen = [f for f in self.functions if self.choice in ("required", "auto") or f["name"] == self.choice]
        options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": f["name"]},
                                   "arguments": f.get("parameters") or {"type": "object"}}} for f in chosen]
        before, after = TAGS if self.tagged else ("", "")
        calls = 'call ("\\n" call)* "\\n"?' if self.parallel and self.tagged else "call"
        rules = [f"start: {calls}" + (" | answer" if self.choice == "auto" else ""),
                 f"call: {before} value {after}",
                 f"value: {json_value(options[0] if len(options) == 1 else {'anyOf': options})}"]
        if self.choice == "auto":
            rules.append(f"answer: {json_value(answer)}")
        try:
            return Grammar("\n".join(rules), "tool schema")
        except GraftError as e:
            raise Refused(str(e), "tools") from None


def structure(body: dict, tagged: bool = True) -> tuple[Tools | None, Grammar | None]:
    """A request's tools (None: none, or ``tool_choice: "none"``) and the grammar its answer must match;
    ``tagged``: the chat template writes calls in Hermes' tags. A response format with tools shapes the answer
    that is not a call (with "auto"; "required" and a named function leave none)."""
    tools = _tools(body, tagged)
    answer = _response_format(body.get("response_format"))
    if tools is None:
        return None, None if answer is None else json_schema(answer)
    return tools, tools.grammar(answer)


def _response_format(value: Any) -> dict | None:
    """The schema a response format asks of the answer (None: free text), checked."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}  # an object, as OpenAI's clients expect
    if kind != "json_schema":
        raise Refused("'response_format.type' must be text, json_object or json_schema", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise Refused("'response_format.json_schema' must be an object with a 'schema' object", "response_format")
    try:
        json_schema(spec.get("schema", {}))
    except GraftError as e:
        raise Refused(str(e), "response_format") from None
    return spec.get("schema", {})


def _tools(body: dict, tagged: bool) -> Tools | None:
    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "none", "auto"):
            raise Refused("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(given, list):
        raise Refused("'tools' must be an array of function tools", "tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(given))
    names = [f["name"] for f in functions]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise Refused(f"'tool_choice' names no function of 'tools' ({', '.join(names)})", "tool_choice")
        choice = name
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise Refused("'tool_choice' must be none, auto, required or {\"type\": \"function\", ...}",
                       "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise Refused("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return None if choice == "none" else Tools(functions, choice, tagged, parallel)


def _function(tool: Any, i: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise Refused(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                       f"tools[{i}]")
    if not isinstance(function.get("parameters", {}), dict):
        raise Refused(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
    return function


def parse_calls(text: str) -> list[dict]:
    """The tool calls an answer holds, as OpenAI's ``tool_calls`` (none: ``[]``): every ``<tool_call>`` block,
    or the whole answer as one bare JSON call; a block that is not a call leaves the answer as text."""
    blocks = CALL.findall(text) or ([text.strip()] if text.strip().startswith("{") else [])
    calls = []
    for block in blocks:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return []
        arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            return []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls


def may_be_call(text: str) -> bool:
    """Whether an answer that begins with ``text`` may still turn out a tool call (a stream holds it back)."""
    start = text.lstrip()
    return not start or start.startswith("{") or OPEN.startswith(start[: len(OPEN)]) or start.startswith(OPEN)


def template_message(message: dict) -> dict:
    """A chat message as templates take it: an assistant's earlier ``tool_calls`` with their arguments as
    objects (OpenAI sends them as JSON text), a tool's answer with its call's id."""
    out = {key: message[key] for key in ("role", "content", "tool_call_id", "name") if key in message}
    if message.get("tool_calls"):
        out["tool_calls"] = [_templated_call(call) for call in message["tool_calls"]]
    return out


def _templated_call(call: Any) -> dict:
    function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        pass  # already an object, or text the template shows as it is
    return {"type": "function", "id": call.get("id"), "function": function}


class HeldText:
    """A stream's text, held back while the answer may still turn out a tool call (then it is sent as
    ``tool_calls``, never as content); once it cannot, what was held goes out and the rest streams as it comes."""

    def __init__(self, tools: Tools | None) -> None:
        self.holding, self.text = tools is not None, ""

    def feed(self, piece: str) -> str:
        """What of the answer may go out now."""
        if not self.holding:
            return piece
        self.text += piece
        if may_be_call(self.text):
            return ""
        self.holding = False
        return self.release()

    def release(self) -> str:
        out, self.text = self.text, ""
        return out


def call_deltas(calls: list[dict]) -> list[list[dict]]:
    """Tool calls as OpenAI streams them: for each, a delta with its id, type and name (arguments empty), then
    one with its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        function = call["function"]
        deltas.append([{"index": i, "id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": ""}}])
        deltas.append([{"index": i, "function": {"arguments": function["arguments"]}}])
    return deltas
