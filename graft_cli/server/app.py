"""The HTTP side of ``graft serve``: OpenAI's endpoints on Starlette, served by uvicorn.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events with ``stream: true``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (metrics.py). Every request is checked on the event loop (a
bad one, an unknown path or method included, is a 4xx at once with an OpenAI-style error object), then handed to the
model's one worker (worker.py). A client that disconnects stops its generation at the next step; one that a
shutdown cuts off is told so, never handed a short answer as if it were whole. docs/serve.md is the manual.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import signal
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from graft_cli.api import Completion, Generator
from graft_cli.core import GraftError
from graft_cli.runtime.limits import TooLong
from graft_cli.server.metrics import Metrics
from graft_cli.server.protocol import CHAT, TEXT, ApiError, Call, chunk, new_id, parse, response, tool_calls
from graft_cli.server.tools import HeldText, call_deltas
from graft_cli.server.worker import Done, Failed, Full, Job, Worker

POLL_S = 0.1  # how often a waiting non-streamed request looks for its client


class Service:
    """What the routes share: the model's name, its worker, and the settings every request gets."""

    def __init__(self, generator: Generator, name: str, max_queue: int, max_tokens: int, api_key: str | None,
                 truncate: str | None) -> None:
        self.generator, self.name, self.max_tokens = generator, name, max_tokens
        self.api_key, self.truncate = api_key, truncate
        prefix = generator.prefix
        self.metrics = Metrics(lambda: (self.worker.waiting, self.worker.busy),
                               None if prefix is None else prefix.figures)
        self.worker = Worker(generator, max_queue, self.metrics.count)
        self.started = int(time.time())
        self.tagged = "<tool_call>" in (generator.loaded.tokenizer.chat_template or "")  # Hermes tool calls

    def retry_after(self) -> int:
        """Seconds until the queue likely has room: the requests waiting, at the mean request's time so far."""
        metrics = self.metrics
        done = sum(metrics.finished.values())
        mean = metrics.seconds / done if done else 1.0
        return max(1, math.ceil(mean * (self.worker.waiting + 1)))

    def authorised(self, request: Request) -> bool:
        return self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}"


def error(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


UNAUTHORISED = ("a valid API key is required (Authorization: Bearer KEY)", "authentication_error", "invalid_api_key")


async def _http_error(request: Request, e: Exception) -> Response:
    """Starlette's own refusals (no such path, a method a path does not take) as OpenAI-style error objects."""
    status = e.status_code if isinstance(e, HTTPException) else 500
    said = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error(ApiError(status, said.get(status, str(getattr(e, "detail", e))), kind=kind,
                          code={404: "not_found", 405: "method_not_allowed"}.get(status)))


def make_app(service: Service) -> Starlette:
    async def health(request: Request) -> Response:
        worker = service.worker
        return JSONResponse({"status": "ok", "model": service.name, "busy": worker.busy, "waiting": worker.waiting})

    async def models(request: Request) -> Response:
        if not service.authorised(request):
            return error(ApiError(401, UNAUTHORISED[0], kind=UNAUTHORISED[1], code=UNAUTHORISED[2]))
        return JSONResponse({"object": "list", "data": [
            {"id": service.name, "object": "model", "created": service.started, "owned_by": "graft"}]})

    async def metrics(request: Request) -> Response:
        if not service.authorised(request):
            return error(ApiError(401, UNAUTHORISED[0], kind=UNAUTHORISED[1], code=UNAUTHORISED[2]))
        return PlainTextResponse(service.metrics.text(), media_type="text/plain; version=0.0.4")

    async def chat(request: Request) -> Response:
        return await complete(service, request, CHAT)

    async def text(request: Request) -> Response:
        return await complete(service, request, TEXT)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
              Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", text, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lambda app: _lifespan(service),
                     exception_handlers={HTTPException: _http_error})


@asynccontextmanager
async def _lifespan(service: Service) -> AsyncIterator[None]:
    yield
    await asyncio.to_thread(service.worker.stop)  # the generator closes: what it keeps on disk is saved


async def complete(service: Service, request: Request, kind: str) -> Response:
    """A completion request: checked, queued, then answered whole or streamed."""
    try:
        if not service.authorised(request):
            raise ApiError(401, UNAUTHORISED[0], kind=UNAUTHORISED[1], code=UNAUTHORISED[2])
        call = parse(await _body(request), kind, service.name, service.max_tokens, service.tagged)
        try:
            checked = service.generator.request(call.prompt, messages=call.messages, truncate=service.truncate,
                                                raw=kind == TEXT, **call.settings)  # a text completion: no template
        except TooLong as e:  # the prompt past the model's context: said with the request's own numbers
            fix = f"shorten the {'messages' if kind == CHAT else 'prompt'} or lower max_tokens"
            raise ApiError(400, e.said("max_tokens", fix), "messages" if kind == CHAT else "prompt",
                           code="context_length_exceeded") from None
        except GraftError as e:  # an empty prompt, a bad stop string
            raise ApiError(400, str(e), "messages" if kind == CHAT else "prompt") from None
        job = Job(checked, asyncio.get_running_loop())
        try:
            service.worker.submit(job)
        except Full:
            wait = service.retry_after()
            return error(ApiError(429, f"the server is busy: {service.worker.max_queue} requests already wait; "
                                       f"retry in about {wait} s", kind="rate_limit_error", code="queue_full"),
                         {"Retry-After": str(wait)})
    except ApiError as e:
        return error(e)
    rid = new_id(kind)
    if call.stream:
        return StreamingResponse(_events(call, rid, job), media_type="text/event-stream")
    return await _whole(call, rid, job, request)


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


async def _whole(call: Call, rid: str, job: Job, request: Request) -> Response:
    """Wait for the completion, looking for the client meanwhile: one that went away cancels its generation."""
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return Response(status_code=499)
            continue
        if isinstance(event, Done):
            if event.completion.finish_reason == "cancelled":
                return error(cut_off(event.completion))
            return JSONResponse(response(call, rid, event.completion))
        if isinstance(event, Failed):
            return error(failed(event))


async def _events(call: Call, rid: str, job: Job) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``[DONE]``. Starlette cancels this generator when
    the client disconnects; ``finally`` then stops the generation at its next step."""
    held = HeldText(call.tools)  # an answer that may be a tool call is sent as one, never as text
    try:
        yield _sse(chunk(call, rid, "", first=True))
        while True:
            event = await job.events.get()
            if isinstance(event, Done):
                done = event.completion
                if done.finish_reason == "cancelled":  # a shutdown cut it off: never a whole answer's ending
                    yield _sse(cut_off(done).body())
                    break
                calls = tool_calls(call, done)
                for delta in call_deltas(calls):
                    yield _sse(chunk(call, rid, None, calls=delta))
                if not calls and (rest := held.release()):
                    yield _sse(chunk(call, rid, rest))
                reason = "tool_calls" if calls else "stop" if done.finish_reason == "stop" else "length"
                yield _sse(chunk(call, rid, None, finish=reason, completion=done))
                break
            if isinstance(event, Failed):
                yield _sse(failed(event).body())
                break
            if event.text and (text := held.feed(event.text)):
                yield _sse(chunk(call, rid, text))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def failed(event: Failed) -> ApiError:
    return ApiError(event.status, event.message, kind="server_error",
                    code="shutting_down" if event.status == 503 else None)


def cut_off(completion: Completion) -> ApiError:
    """A generation the server's shutdown stopped before its end."""
    return ApiError(503, f"the server is shutting down: the answer was cut off after {len(completion.token_ids)} "
                         "tokens; send the request again", kind="server_error", code="cancelled")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Server(uvicorn.Server):
    """uvicorn, with graft's shutdown: on SIGTERM or Ctrl-C what runs is cancelled at its next step and what waits
    is skipped, so a long stream does not hold the shutdown; a SIGTERM then ends the process with exit 0."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self.worker.cancel_all()
        if sig == signal.SIGTERM:  # a requested stop is a clean exit, not a death by signal
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything says the server is ready; a GraftError line when it cannot be
    (the port in use, an address this machine does not have)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise GraftError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # connections wait in the backlog until the server accepts them
    except OSError as e:
        sock.close()
        why = "the port is in use (give another with --port)" if e.errno == errno.EADDRINUSE else e.strerror or e
        raise GraftError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(service: Service, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve on ``sock`` (from :func:`bind`) until SIGTERM or Ctrl-C."""
    config = uvicorn.Config(make_app(service), log_level=log_level, access_log=False, timeout_graceful_shutdown=5,
                            lifespan="on")
    Server(config, service.worker).run(sockets=[sock])
