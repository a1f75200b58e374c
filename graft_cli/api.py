"""graft as a library: a model and a method loaded once, then generations with the command line's guarantees.

    import graft_cli
    g = graft_cli.load("smollm2-135m-instruct", method="graft", datastores=["corpus"])
    c = g.generate("Explain KV caches in two sentences.", max_new_tokens=128)   # or messages=[...]
    c.text, c.token_ids, c.stats
    for piece in g.stream("...", temperature=0.7, seed=1):
        print(piece.text, end="")

``graft generate`` runs through this module too, so a library call and the command give the same text for the
same settings (greedy, or sampled with the same seed), whatever the method. A :class:`Generator` serves one
generation at a time: its proposer learns across them (calibration, the recycling table), which is why it is
kept, and why two threads may not share it. docs/api.md is the manual.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from graft_cli import methods
from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.core import DraftSettings, GraftError, Options, Stats
from graft_cli.drafting import match_target
from graft_cli.method_config import MethodConfig, parse_budget, tree_reach
from graft_cli.runtime import decode
from graft_cli.runtime.limits import parse_truncate
from graft_cli.runtime.loading import Loaded, encode, load_model, parse_device_map, stop_ids
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.fixed_target import make_target, use_graphs
from graft_cli.runtime.target import Progress

Prompt = str | list[dict]


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


class Generator:
    """A loaded target and a method's proposer, for any number of generations, one at a time."""

    def __init__(self, loaded: Loaded, config: MethodConfig, prefill_chunk: int = 512,
                 progress: Progress | None = None, graphs: str = "auto") -> None:
        self.loaded, self.config = loaded, config
        self.target = make_target(loaded.model, graphs, prefill_chunk, progress)
        self.proposer = match_target(methods.build(config, loaded), self.target)
        _check_options(config.options, config.method)
        self.stop_ids = stop_ids(loaded)
        self.reach = tree_reach(config, loaded.device)  # the tree room a request must leave below the model's limits
        self._busy = threading.Lock()

    def request(self, prompt: Prompt | None = None, *, messages: list[dict] | None = None, system: str | None = None,
                max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, stop: Sequence[str] = (), raw: bool = False,
                truncate: str | None = None) -> Request:
        """A request checked and encoded, without generating: a bad one is a GraftError before any forward."""
        if max_new_tokens < 1:
            raise GraftError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        try:
            sampling = Sampling(temperature, top_k, top_p)
        except ValueError as e:
            raise GraftError(str(e)) from e
        stops = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise GraftError("a stop string must be non-empty text")
        ids = encode(self.loaded.tokenizer, _chat(prompt, messages, system, raw), raw)
        ids = self.loaded.limits.fit(ids, max_new_tokens, self.reach, parse_truncate(truncate))
        return Request(ids, sampling, max_new_tokens, random.randrange(2**31) if seed is None else seed, stops)

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
        if not self._busy.acquire(blocking=False):
            raise GraftError("this Generator is already generating (in another thread, or an unfinished stream): "
                             "use one Generator per thread and finish or close a stream before the next")
        return Stream(self, request, should_stop)

    def close(self) -> None:
        """End of the session: retrievers that keep state on disk (an adjacency file) save it."""
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
    stats, text, ids = Stats(), _Text(generator.loaded.tokenizer, generator.stop_ids, request.stop), []
    steps = decode(generator.target, generator.proposer, request.prompt_ids, request.sampling,
                   request.max_new_tokens, generator.stop_ids, request.seed, stats)
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
        stream.completion = Completion(text.text, ids, len(request.prompt_ids), reason, stats, request.seed)
    finally:
        steps.close()
        generator._busy.release()


@dataclass
class _Text:
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


def _chat(prompt: Prompt | None, messages: list[dict] | None, system: str | None, raw: bool) -> Prompt:
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
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise GraftError(f'messages[{i}] must be an object with "role" and "content" texts')
        return ([{"role": "system", "content": system}] if system is not None else []) + messages
    if not isinstance(prompt, str):
        raise GraftError(f"the prompt must be text, not {type(prompt).__name__}")
    if system is None:
        return prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def _check_options(options: Options, method: str) -> None:
    """Every retriever option must be read by a retriever of this method (a typo is never silently ignored)."""
    flags = {"datastore": "--datastore", "adjacency_file": "--adjacency-file"}
    unread = options.unread()
    if unread:
        key = unread[0]
        what = flags.get(key, f"--retriever-opt {key}={options.peek(key)}")
        read = ", ".join(sorted(options.read)) or "none"
        raise GraftError(f"{what}: no retriever of --method {method} reads it (the options they read: {read})")


def open_generator(model: str, config: MethodConfig, device: str = "auto", dtype: str = "auto",
                   device_map: str | dict | None = None, prefill_chunk: int = 512,
                   progress: Progress | None = None, graphs: str = "auto") -> Generator:
    """A Generator for a method configuration: the configuration and its datastore checked before the model loads
    (a wrong flag should not cost seconds). ``graphs``: auto, on or off (``--graphs``: the fixed-shape path)."""
    methods.check(config)
    methods.check_datastore(config)
    use_graphs(graphs, "cpu")  # a bad value fails here, before the model loads
    loaded = load_model(model, device, dtype, parse_device_map(device_map))
    return Generator(loaded, config, prefill_chunk, progress, graphs)


def load(model: str = DEFAULT_MODEL, *, method: str = "graft", draft: str | None = None,
         datastores: Sequence[str] = (), retrievers: Sequence[str] | None = None,
         retriever_options: dict[str, str] | None = None, budget: int | str | None = None, tree: str | None = None,
         device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None, prefill_chunk: int = 512,
         adjacency_file: str | None = None, graphs: str = "auto", **drafting: Any) -> Generator:
    """A model (catalog name, path, or hub id) and a method, ready to generate. ``drafting``: any
    :class:`~graft_cli.core.DraftSettings` field (``depth``, ``draft_top_k``, ``prune_at``, ``chain``, ...).
    ``graphs``: ``on`` verifies at fixed shapes, captured as CUDA graphs on a GPU; ``auto``: on CUDA only."""
    options = Options(retriever_options or {})
    if len(datastores) > 1:
        raise GraftError("a Generator retrieves from one datastore (give one in datastores)")
    if datastores:
        options["datastore"] = str(datastores[0])
    if adjacency_file is not None:
        options["adjacency_file"] = str(adjacency_file)
    try:
        settings = DraftSettings(**drafting)
    except TypeError as e:
        raise GraftError(f"load(): {e}") from None
    config = MethodConfig(method, parse_budget(budget), list(retrievers) if retrievers is not None else None,
                          options, draft, settings, tree=tree)
    return open_generator(model, config, device, dtype, device_map, prefill_chunk, graphs=graphs)
