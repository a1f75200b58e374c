"""Retriever over a suffix-array datastore (``graft index build --kind suffix-array``).

Entry point ``suffix-array = "plugins.suffix_array:make"``. Options (``env.options``, strings; a key prefixed
with the retriever's name, e.g. ``suffix-array.datastore``, wins over the plain key):

``datastore``        store name (under ``$GRAFT_HOME/datastores``) or path -- required
``max_match``        longest context suffix tried (16)
``min_match``        shortest suffix accepted (2)
``depth``            longest continuation proposed (8)
``max_occurrences``  occurrences counted per lookup, evenly spaced over the match (512)
``prior``            score = count / (occurrences + prior) (1.0)
``verify``           ``1`` to check full SHA-256 of every file at open (slow on big stores)

Each node's score is the share of the matched suffix's occurrences that continue with its path -- the
product of child/parent counts down the path, shrunk by ``prior`` -- an estimate of the probability that the
target accepts that path, comparable across retrievers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from graft_cli.errors import GraftError
from graft_cli.tree import ROOT, Tree
from plugins.base import RetrieverEnv, Step

_OPEN: dict[tuple[str, str | None, str], Any] = {}  # opened stores, shared by the retrievers of one process


def option(env: RetrieverEnv, name: str, key: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    """``env.options["<name>.<key>"]``, else ``env.options[key]``, else ``default``, cast with ``cast``."""
    opts = env.options or {}
    raw = opts.get(f"{name}.{key}", opts.get(key))
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except (TypeError, ValueError):
        raise GraftError(f"retriever {name}: option {key} must be a {cast.__name__}, not {raw!r}") from None


def _home():
    try:
        from graft_cli.catalog import graft_home
    except ImportError:  # pragma: no cover - the catalog ships with graft
        return None
    return graft_home()


def open_datastore(env: RetrieverEnv, name: str, kind: str):
    """Open the store named by the ``datastore`` option, checking its kind and tokenizer."""
    from datastores import DatastoreError, fingerprint_from_tokenizer, open_store, resolve_store

    spec = option(env, name, "datastore", None)
    if not spec:
        raise GraftError(f"retriever {name} needs a datastore (--datastore NAME_OR_PATH; `graft index list` shows them)")
    try:
        path = resolve_store(spec, _home())
        fingerprint = fingerprint_from_tokenizer(env.tokenizer) if env.tokenizer is not None else None
        verify = option(env, name, "verify", False, lambda s: str(s).lower() in ("1", "true", "yes"))
        key = (str(path.resolve()), fingerprint, env.device)
        index = _OPEN.get(key)
        if index is None or verify:
            index = open_store(path, fingerprint=fingerprint, verify=verify, device=env.device)
            _OPEN[key] = index
    except DatastoreError as e:
        raise GraftError(str(e)) from e
    if index.kind != kind:
        raise GraftError(f"datastore {spec} is a {index.kind} store; the {name} retriever reads {kind} stores")
    return index


def lookup_to_tree(lookup: Any, source: str) -> Tree:
    tree = Tree()
    where: list[int] = []
    for node in lookup.nodes:
        parent = ROOT if node.parent < 0 else where[node.parent]
        where.append(tree.add(parent, node.token, source, node.score))
    return tree


class SuffixArrayRetriever:
    """Longest-suffix match in a suffix-array store; continuations counted into a scored trie."""

    name = "suffix-array"

    def __init__(self, env: RetrieverEnv) -> None:
        self.index = open_datastore(env, self.name, "suffix-array")
        n = self.name
        self.params = {
            "max_match": option(env, n, "max_match", 16, int),
            "min_match": option(env, n, "min_match", 2, int),
            "depth": option(env, n, "depth", 8, int),
            "max_occurrences": option(env, n, "max_occurrences", 512, int),
            "prior": option(env, n, "prior", 1.0, float),
        }
        if self.params["min_match"] < 1 or self.params["max_match"] < self.params["min_match"]:
            raise GraftError(f"retriever {n}: need 1 <= min_match <= max_match")
        if self.params["depth"] < 1 or self.params["max_occurrences"] < 1 or self.params["prior"] < 0:
            raise GraftError(f"retriever {n}: depth and max_occurrences must be at least 1, prior at least 0")
        self.last = None  # the last lookup, for stats and debugging

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        if budget <= 0 or not context:
            return Tree()
        self.last = self.index.lookup(context, budget=budget, **self.params)
        return lookup_to_tree(self.last, self.name)

    def observe(self, step: Step) -> None:
        pass


def make(env: RetrieverEnv) -> SuffixArrayRetriever:
    return SuffixArrayRetriever(env)
