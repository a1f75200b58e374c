"""What the datastore retrievers share: opening a store (checked for kind and tokenizer, opened once per process),
and the retriever shape itself, so that a store retriever only says which store kind it reads and which lookup
parameters it takes."""

from __future__ import annotations

from typing import Any, Sequence

from datastores import DatastoreError, fingerprint_from_tokenizer, open_store, resolve_store
from graft_cli.plugin import GraftError, RetrieverDefaults, RetrieverEnv, Step, Tree, graft_home, option
from plugins.calibration import LookupCalibration, match_group

_OPEN: dict[tuple[str, str | None, str], Any] = {}  # opened stores, shared by the retrievers of one process


def open_datastore(env: RetrieverEnv, name: str, kind: str):
    """Open the store named by the ``datastore`` option, checking its kind and tokenizer."""
    spec = option(env, "datastore", None)
    if not spec:
        raise GraftError(f"retriever {name} needs a datastore (--datastore NAME_OR_PATH; `graft index list` shows them)")
    try:
        path = resolve_store(spec, graft_home())
        fingerprint = fingerprint_from_tokenizer(env.tokenizer) if env.tokenizer is not None else None
        verify = option(env, "verify", False, bool)
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


def to_tree(nodes: Sequence[Any], source: str) -> Tree:
    """A store's continuation nodes (each with ``token``, ``parent`` index or -1, ``score``) as a Tree."""
    return Tree.from_arrays([n.token for n in nodes], [n.parent for n in nodes], [n.score for n in nodes], source)


class StoreRetriever(RetrieverDefaults):
    """A retriever that looks the context up in an on-disk store; subclasses set ``name``, ``kind`` and
    ``defaults`` (the keyword arguments of the store's ``lookup``, each an option read as its default's type), and
    refuse the values the lookup cannot take in :meth:`check`."""

    name = ""
    kind = ""
    defaults: dict[str, int | float] = {}
    calibrated = True  # by LookupCalibration, per matched length

    def __init__(self, env: RetrieverEnv) -> None:
        self.index = open_datastore(env, self.name, self.kind)
        self.params = {key: option(env, key, value, type(value)) for key, value in self.defaults.items()}
        self.check(self.params)
        self.last = None  # the last lookup, for stats and debugging
        self.calibration = LookupCalibration()  # its one calibration layer (the proposer adds none)

    def check(self, params: dict[str, Any]) -> None:
        """Raise GraftError for a value of ``params`` the lookup cannot take."""

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        if budget <= 0 or not context:
            return Tree()
        self.last = self.index.lookup(context, budget=budget, **self.params)
        group = match_group(self.last.match_len, cap=8)
        return self.calibration.apply(to_tree(self.last.nodes, self.name), len(context), group)

    def observe(self, step: Step) -> None:
        self.calibration.observe(step)
