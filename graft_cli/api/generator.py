"""A loaded target and a method's proposer, generating one request at a time: a :class:`Generator` serves one
generation at a time, since its proposer learns across them (calibration, the recycling table), which is why it
is kept, and why two threads may not share it."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from graft_cli.api.capture_check import first_use
from graft_cli.api.structured import Grammars
from graft_cli.api.text import Prompt, TextPieces, chat_prompt
from graft_cli.core import GraftError, Options, Stats
from graft_cli.grammar import Grammar
from graft_cli.method import builder as methods
from graft_cli.method.config import MethodConfig, tree_budget
from graft_cli.runtime import decode
from graft_cli.runtime.fixed_target import make_target
from graft_cli.runtime.limits import parse_truncate
from graft_cli.runtime.loading import Loaded, encode, stop_ids
from graft_cli.runtime.prefix_cache import PREFIX_CACHE_MIB, prefix_cache_for
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Progress


@dataclass(frozen=True)
class Piece:
    """New text of one step (held back while it ends inside a UTF-8 character or may begin a stop string)."""

    text: str
    token_ids: list[int]  # the tokens the step accepted (a piece may carry tokens and no text yet)


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # every token generated (a stop string may end inside the last step's tokens)
    prompt_tokens: int
    finish_reason: str  # "stop": an end-of-text token or a stop string; "length": max_new_tokens; "cancelled"
    stats: Stats  # tau, steps, tokens_per_s, accepted tokens by source, time by phase (Stats.as_dict for JSON)
    seed: int  # the seed the text was sampled with (greedy text does not depend on it)


@dataclass(frozen=True)
class Request:
    """One generation's settings, checked before any forward."""

    prompt_ids: list[int]
    sampling: Sampling
    max_new_tokens: int
    seed: int
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None  # what the text must match (a JSON schema, a regular expression)


class Generator:
    """A loaded target and a method's proposer, for any number of generations, one at a time."""

    def __init__(self, loaded: Loaded, config: MethodConfig, prefill_chunk: int = 512,
                 progress: Progress | None = None, graphs: str = "auto",
                 prefix_cache: float = PREFIX_CACHE_MIB) -> None:
        self.loaded, self.config = loaded, config
        self.target = make_target(loaded.model, graphs, prefill_chunk, progress)
        self.proposer = methods.build(config, loaded, self.target)
        check_options(config.options, config.method)
        verdict = first_use(loaded, config, self.target, self.proposer)  # the captured path's, once per method
        if verdict is not None and not verdict.ok:
            self.target = make_target(loaded.model, "off", prefill_chunk, progress)
            self.proposer = methods.build(config, loaded, self.target)
        self.prefix = prefix_cache_for(prefix_cache, self.target, self.proposer.drafter)  # None: off
        self.stop_ids = stop_ids(loaded)
        self.reach = tree_budget(config, loaded.device)  # the tree room a request must leave below the model's limits
        self._busy = threading.Lock()
        self._closed = False
        self.grammars = Grammars(loaded.tokenizer, self.target.vocab_size, self.stop_ids, config.method != "ar")

    def request(self, prompt: Prompt | None = None, *, messages: list[dict] | None = None, system: str | None = None,
                max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, stop: Sequence[str] = (), raw: bool = False,
                truncate: str | None = None, json_schema: dict | str | None = None, regex: str | None = None,
                grammar: Grammar | None = None, tools: list[dict] | None = None) -> Request:
        """A request checked and encoded, without generating: a bad one is a GraftError before any forward.
        ``json_schema`` (``{}``: any JSON), ``regex`` or a prebuilt ``grammar``: the text must match it whole; an
        answer cut by ``max_new_tokens`` before it does ends with ``finish_reason`` "length". ``tools``: OpenAI
        function tools, rendered by the chat template (one that knows none is a GraftError)."""
        if max_new_tokens < 1:
            raise GraftError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        try:
            sampling = Sampling(temperature, top_k, top_p)
        except ValueError as e:
            raise GraftError(str(e)) from e
        stops = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise GraftError("a stop string must be non-empty text")
        grammar = self.grammars.checked(json_schema, regex, grammar)
        ids = encode(self.loaded.tokenizer, chat_prompt(prompt, messages, system, raw), raw, tools)
        ids = self.loaded.limits.fit(ids, max_new_tokens, self.reach, parse_truncate(truncate))
        return Request(ids, sampling, max_new_tokens, random.randrange(2**31) if seed is None else seed, stops,
                       grammar)

    def generate(self, prompt: Prompt | None = None, **settings: Any) -> Completion:
        """The whole completion at once (settings: those of :meth:`request`)."""
        stream = self.stream(prompt, **settings)
        for _ in stream:
            pass
        return stream.completion

    def stream(self, prompt: Prompt | None = None, **settings: Any) -> Stream:
        """The completion piece by piece as steps are accepted; ``.completion`` once it is exhausted."""
        return self.run(self.request(prompt, **settings))

    def run(self, request: Request, should_stop: Callable[[], bool] | None = None) -> Stream:
        """Generate ``request``; ``should_stop`` (asked after each step) ends it early, as a client that went
        away ends a server's generation."""
        if self._closed:
            raise GraftError("this Generator is closed: open a new one (graft_cli.load) to generate again")
        if not self._busy.acquire(blocking=False):
            raise GraftError("this Generator is already generating (in another thread, or an unfinished stream): "
                             "use one Generator per thread and finish or close a stream before the next")
        return Stream(self, request, should_stop)

    def close(self) -> None:
        """End of the session: retrievers that keep state on disk (an adjacency file) save it. A closed Generator
        refuses to generate (its retrievers' state is saved and may be released); closing twice does nothing."""
        if not self._closed:
            self._closed = True
            self.proposer.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream:
    """The pieces of one generation. It holds its Generator until exhausted or closed."""

    def __init__(self, generator: Generator, request: Request, should_stop: Callable[[], bool] | None) -> None:
        self.completion: Completion | None = None
        self._pieces = _pieces(generator, request, should_stop, self)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Piece:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating now; the Generator is free again."""
        self._pieces.close()


def _pieces(generator: Generator, request: Request, should_stop: Callable[[], bool] | None,
            stream: Stream) -> Iterator[Piece]:
    """The generation itself: the decoding loop's steps turned into text pieces, stopped by an end-of-text token,
    a stop string, ``max_new_tokens`` or ``should_stop``."""
    stats, text, ids = Stats(), TextPieces(generator.loaded.tokenizer, generator.stop_ids, request.stop), []
    constraint = generator.grammars.constraint(request.grammar, generator.proposer.recorder.clock, request.prompt_ids)
    steps = decode(generator.target, generator.proposer, request.prompt_ids, request.sampling,
                   request.max_new_tokens, generator.stop_ids, request.seed, stats, constraint, generator.prefix)
    cancelled = False
    try:
        for new in steps:
            ids.extend(new)
            piece = text.feed(new)
            if piece:
                yield Piece(piece, list(new))
            cancelled = should_stop is not None and should_stop()
            if text.stopped or cancelled:
                break
        rest = text.flush()
        if rest:
            yield Piece(rest, [])
        ended = text.stopped or bool(ids and ids[-1] in generator.stop_ids)
        reason = "stop" if ended else "cancelled" if cancelled else "length"
        if constraint is not None:
            stats.times["grammar"] += constraint.seconds  # host time on masks, checks and forced tokens
        stream.completion = Completion(text.text, ids, len(request.prompt_ids), reason, stats, request.seed)
    finally:
        steps.close()
        generator._busy.release()


def check_options(options: Options, method: str) -> None:
    """Every retriever option must be read by a retriever of this method (a typo is never silently ignored)."""
    flags = {"datastore": "--datastore", "adjacency_file": "--adjacency-file"}
    unread = options.unread()
    if unread:
        key = unread[0]
        what = flags.get(key, f"--retriever-opt {key}={options.peek(key)}")
        read = ", ".join(sorted(options.read)) or "none"
        raise GraftError(f"{what}: no retriever of --method {method} reads it (the options they read: {read})")
