"""The OpenAI API as graft serves it: request bodies checked and turned into generation settings, and the response
objects and stream chunks built from what a generation returned.

What graft cannot honour is refused with a 400 that names the parameter (``n`` above 1, ``logprobs``, ...),
never silently dropped; an unknown field that changes nothing is ignored, as OpenAI's own servers do.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from graft_cli.api import Completion
from graft_cli.server.tools import Refused, Tools, parse_calls, structure, template_message

CHAT, TEXT = "chat.completion", "text_completion"
# parameters graft cannot honour, and the values that mean "not asked for"
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0),
    "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
}


class ApiError(Exception):
    """A request the server refuses: its HTTP status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Call:
    """A checked request: what to generate, and how to answer."""

    kind: str  # CHAT or TEXT
    model: str
    prompt: str | None  # a completion's prompt
    messages: list[dict] | None  # a chat's messages
    settings: dict  # Generator.request's keyword arguments
    stream: bool
    usage_in_stream: bool  # stream_options.include_usage
    tools: Tools | None = None  # the tools an answer may call (parsed into tool_calls)


def parse(body: Any, kind: str, model: str, max_tokens: int, tagged: bool = True) -> Call:
    """A request body to a :class:`Call`; an ApiError (400) for anything malformed or unsupported. ``model``: the
    name the server answers to; ``max_tokens``: the default when the body gives none; ``tagged``: the model's
    chat template writes tool calls in Hermes' tags."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, absent in UNSUPPORTED.items():
        if body.get(name, None) not in absent:
            raise ApiError(400, f"'{name}' is not supported by graft serve", name, code="unsupported_parameter")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1: graft serve generates one choice per request, got {n!r}", "n",
                       code="unsupported_parameter")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise ApiError(400, "'model' is required", "model")
    if asked != model:
        raise ApiError(400, f"the model '{asked}' does not exist here (this server serves '{model}')", "model",
                       code="model_not_found")
    prompt, messages = _input(body, kind)
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    try:
        tools, grammar = structure(body, tagged)
    except Refused as e:
        raise ApiError(400, e.message, e.param) from None
    if tools is not None and kind != CHAT:
        raise ApiError(400, "'tools' need /v1/chat/completions (a chat template renders them)", "tools")
    settings = {**_settings(body, max_tokens), "grammar": grammar,
                **({"tools": tools.rendered()} if tools is not None else {})}
    return Call(kind, model, prompt, messages, settings, stream, bool(options.get("include_usage")), tools)


def _input(body: dict, kind: str) -> tuple[str | None, list[dict] | None]:
    if kind == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array", "messages")
        return None, [_message(m, i) for i, m in enumerate(messages)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (one prompt per request)", "prompt")
    return prompt, None


def _message(m: Any, i: int) -> dict:
    """A chat message with text content (a list of text parts is joined; other parts are refused); an assistant's
    tool calls (then its content may be null) and a tool's answer go to the template as they came."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = m.get("content")
    if content is None and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
        return template_message({**m, "content": ""})
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}]: only text content is supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be text", f"messages[{i}].content")
    return template_message({**m, "content": content})


def _settings(body: dict, default_tokens: int) -> dict:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = default_tokens if limit is None else limit
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ApiError(400, f"'max_tokens' must be a positive integer, got {limit!r}", "max_tokens")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or up to 4 non-empty strings", "stop")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "'top_p' must be above 0", "top_p")
    top_k = body.get("top_k", 0)  # not OpenAI's: vLLM's and llama.cpp's extension, which clients send as extra_body
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ApiError(400, "'top_k' must be a non-negative integer (0: every token)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ApiError(400, "'seed' must be a non-negative integer", "seed")
    return dict(max_new_tokens=limit, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}", name)
    return float(value)


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", name)
    return value


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(completion: Completion) -> dict:
    generated = len(completion.token_ids)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": completion.stats.cached_tokens}}


def graft_figures(completion: Completion) -> dict:
    """graft's own figures for a request: its one extra field in a response and in the final chunk."""
    stats = completion.stats
    return {"tau": round(stats.tau, 3), "steps": stats.steps, "tokens_per_s": round(stats.tokens_per_s, 2),
            "accepted": dict(stats.accepted), "seed": completion.seed}


def response(call: Call, rid: str, completion: Completion) -> dict:
    """The whole answer of a request that did not stream (an answer that calls tools: its ``tool_calls``)."""
    reason = "stop" if completion.finish_reason == "stop" else "length"
    calls = tool_calls(call, completion)
    if call.kind == CHAT:
        message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": completion.text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if calls else reason}
    else:
        choice = {"index": 0, "text": completion.text, "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": call.kind, "created": int(time.time()), "model": call.model, "choices": [choice],
            "usage": usage(completion), "graft": graft_figures(completion)}


def tool_calls(call: Call, completion: Completion) -> list[dict]:
    """The tool calls of a finished answer to a request with tools (an answer cut by the limit calls none)."""
    if call.tools is None or completion.finish_reason != "stop":
        return []
    return parse_calls(completion.text)


def chunk(call: Call, rid: str, text: str | None, finish: str | None = None, first: bool = False,
          completion: Completion | None = None, calls: list[dict] | None = None) -> dict:
    """One server-sent event of a stream: a piece of text or of tool calls (OpenAI's ``delta.tool_calls``), or
    (with ``completion``) the last one, with the finish reason, graft's figures, and the usage when asked for."""
    if call.kind == CHAT:
        delta: dict = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = TEXT
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": call.model, "choices": [choice]}
    if completion is not None:
        out["graft"] = graft_figures(completion)
        if call.usage_in_stream:
            out["usage"] = usage(completion)
    return out
