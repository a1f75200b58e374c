"""One configuration object for a method and its drafter, checked before the model loads.

| method | drafter | pruning | retrievers (default) |
|---|---|---|---|
| ar | - | - | - |
| pld | - | - | prompt |
| recycling | - | - | recycling (Token Recycling's adjacency table) |
| rest | - | - | suffix-array (REST: the --datastore alone) |
| dense | --draft (required) | - | - (the EAGLE-2/3 baseline: the draft fills the whole budget) |
| pruned | --draft (required) | --prune-at | - |
| graft | --draft (optional) | --prune-at | prompt, recycling (+ suffix-array with --datastore) |

graft with a drafter builds its tree by cost (``--tree cost``, graft_cli/drafting/objective.py): retrieval first,
the retrieved chain checked in the draft's first forward, draft levels only while they raise the expected tokens
per second (up to ``--depth``, 24 by default), pruning checkpoints replaced by that rule (the expansion floor
stays). ``--tree fixed`` keeps the fixed depth and checkpoints. ``--chain`` makes the drafter draft one path; with
``graft`` that is Graft(TAIL): the confident prefix of the chain is kept and the rest of the budget is filled with
retrieved tokens, from the root and after the chain.

``--draft KIND:SPEC`` names a drafter plugin of the ``graft.drafters`` entry-point group. KIND is the text before
the first ``:`` only when a drafter of that name is installed, so a model path that holds a ``:`` still names a
draft model; so does anything with no known kind in front (``--draft qwen2.5-coder-0.5b`` means
``--draft model:qwen2.5-coder-0.5b``). A name in front that is neither installed nor a path is a typo, or a plugin
not installed: that is an error, not a model to look for.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from graft_cli.core import discovery
from graft_cli.core.defaults import MAX_LEVELS
from graft_cli.core import defaults_for, DEFAULT_SCHEDULE, DraftSettings, GraftError, Options, PruneSchedule

STORE_RETRIEVER = "suffix-array"  # joins graft's defaults when a --datastore is given
RETRIEVERS = {  # method -> the retrievers it uses by default
    "ar": [],
    "pld": ["prompt"],
    "recycling": ["recycling"],
    "rest": [STORE_RETRIEVER],
    "dense": [],
    "pruned": [],
    "graft": ["prompt", "recycling"],
}
METHODS = tuple(RETRIEVERS)
NEEDS_DRAFT = ("dense", "pruned")
TAKES_DRAFT = ("dense", "pruned", "graft")
DRAFT_WEIGHTS = ("fp16", "full")
MIN_WINDOW = 64  # a draft window this short would leave the draft almost nothing to read
CURVES = ("cpu", "cuda")
# what vLLM users call a method, where graft's means the same: name -> (graft's method, the drafter kind it implies)
ALIASES = {"ngram": ("pld", None), "eagle3": ("dense", "eagle3"), "draft_model": ("dense", "model")}
ALIAS_HELP = ", ".join(f"{name} ({method}{' with --draft ' + kind + ':...' if kind else ''})"
                       for name, (method, kind) in ALIASES.items())
DEFAULT_KIND = "model"  # a --draft with no known kind in front
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.+-]+")  # what a kind looks like: no '/', no drive letter


@dataclass
class MethodConfig:
    """A method's settings, each in one type whoever gives it (the command line's text, the API's values, a
    bench column's): made by :func:`configure`, built into a proposer by ``graft_cli.method.builder.build``."""

    method: str = "graft"
    budget: int | str | None = None  # verification nodes per step; None: the device's default; "auto": measured
    retrievers: list[str] | None = None  # None: the method's default list
    options: Options = field(default_factory=Options)  # retriever options, e.g. datastore=...
    draft: str | None = None  # --draft: a draft model, or KIND:SPEC of a graft.drafters plugin (eagle3:DIR, ...)
    drafting: DraftSettings = field(default_factory=DraftSettings)  # how the drafter grows its tree
    tree: str | None = None  # "cost" (graft's default with a drafter) or "fixed"
    curve: str | None = None  # "cpu" or "cuda": choose trees by that device's default latency curve, not this one's

    def __post_init__(self) -> None:
        self.budget = parse_budget(self.budget)  # text or a number: one type from here on
        if isinstance(self.retrievers, str):  # "a,b" as the command line gives it
            self.retrievers = [name for name in self.retrievers.split(",") if name]
        if not isinstance(self.options, Options):  # a plain dict from a caller: the same keys, reads now counted
            self.options = Options(self.options)
        if self.method in ALIASES:  # a vLLM name: graft's method, and the drafter kind the name implies
            self.method, kind = ALIASES[self.method]
            if kind and self.draft and ":" not in self.draft.split("/")[0]:
                self.draft = f"{kind}:{self.draft}"


def configure(method: str = "graft", *, budget: int | str | None = None, retrievers: str | list[str] | None = None,
              datastore: str | None = None, adjacency_file: str | None = None,
              retriever_options: dict[str, str] | None = None, draft: str | None = None, tree: str | None = None,
              curve: str | None = None, **drafting: Any) -> MethodConfig:
    """The one way a method's settings are made, from the command line, the API, ``graft bench`` and the scripts:
    ``--datastore`` and ``--adjacency-file`` join the retriever options here, ``drafting`` is any
    :class:`DraftSettings` field (an unknown one is a GraftError)."""
    options = retriever_settings(retriever_options, datastore, adjacency_file)
    try:
        settings = DraftSettings(**drafting)
    except TypeError as e:
        raise GraftError(f"not a drafting setting: {e}") from None
    return MethodConfig(method, budget, retrievers, options, draft, settings, tree, curve)


def retriever_settings(options: dict[str, str] | None, datastore: str | None = None,
                       adjacency_file: str | None = None) -> Options:
    """The options every retriever is built with: ``--retriever-opt`` pairs, with ``--datastore`` and
    ``--adjacency-file`` joining them here (and nowhere else)."""
    joined = Options(options or {})
    for key, value in (("datastore", datastore), ("adjacency_file", adjacency_file)):
        if value:
            joined[key] = str(value)
    return joined


def parse_budget(value: str | int | None) -> int | str | None:
    """``--budget`` text to what MethodConfig takes: None, a positive int, or "auto"."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise GraftError(f"--budget must be 'auto' or a number >= 0, got {value}")
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = int(text)
    except ValueError:
        raise GraftError(f"--budget must be 'auto' or a number of tree nodes, got '{value}'") from None
    if number < 0:
        raise GraftError(f"--budget must be 'auto' or a number >= 0, got {value}")
    return number


def check(config: MethodConfig) -> None:
    """What can be checked before the model loads: the method and its flags."""
    method, drafting = config.method, config.drafting
    if method not in RETRIEVERS:
        raise GraftError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if method in NEEDS_DRAFT and not config.draft:
        raise GraftError(f"--method {method} needs a drafter: --draft MODEL or --draft eagle3:DIR")
    if config.draft and method not in TAKES_DRAFT:
        raise GraftError(f"--method {method} does not use a drafter (use dense, pruned or graft with --draft)")
    if config.draft:
        parse_draft(config.draft)  # an unknown KIND: fails here, before the model loads
    if method == "rest" and not config.options.peek("datastore"):
        raise GraftError("--method rest retrieves from a datastore: give --datastore NAME_OR_PATH")
    if drafting.chain and not config.draft:
        raise GraftError("--chain needs a drafter (--draft)")
    if drafting.prune_at is not None and method == "dense":
        raise GraftError("--prune-at prunes the draft tree: use --method pruned or graft, not dense")
    window = drafting.draft_window
    if window is not None and (window < 0 or 0 < window <= MIN_WINDOW):
        raise GraftError(f"--draft-window must be 0 (the whole prompt) or more than {MIN_WINDOW} tokens")
    if drafting.draft_weights not in (None, *DRAFT_WEIGHTS):
        raise GraftError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got '{drafting.draft_weights}'")
    if config.tree not in (None, "cost", "fixed"):
        raise GraftError(f"--tree must be 'cost' or 'fixed', got '{config.tree}'")
    if config.curve is not None and config.curve not in CURVES:
        raise GraftError(f"curve={config.curve}: choose trees by one of {', '.join(CURVES)}'s latency curves")
    if config.tree == "cost" and (method != "graft" or not config.draft):
        raise GraftError("--tree cost chooses a drafter's tree: it needs --method graft and --draft")


RESPONSE_CACHE = "responses"  # the retriever of earlier responses, on for long-running sessions
CACHED_METHODS = ("graft", "pld")  # methods whose default retrievers it joins


def with_response_cache(config: MethodConfig) -> MethodConfig:
    """``config`` retrieving from earlier responses too, where that is the method's default to change: a session
    that answers many requests (``graft serve``, a ``--jsonl`` batch) repeats itself. A user's own
    ``--retrievers`` list stays as given."""
    if config.retrievers is not None or config.method not in CACHED_METHODS:
        return config
    return replace(config, retrievers=[*retrievers_for(config), RESPONSE_CACHE])


def retrievers_for(config: MethodConfig) -> list[str]:
    """The retrievers a method uses: the user's list, else the method's own, with the datastore's for graft when
    one is given."""
    if config.retrievers is not None:
        return list(config.retrievers)
    names = list(RETRIEVERS[config.method])
    if config.method == "graft" and config.options.peek("datastore"):
        names.append(STORE_RETRIEVER)
    return names


def tree_mode(config: MethodConfig) -> str:
    """graft with a drafter builds its tree by cost unless told otherwise; every other method's is fixed."""
    if config.tree is not None:
        return config.tree
    return "cost" if config.method == "graft" and config.draft else "fixed"


def sized_per_step(config: MethodConfig) -> bool:
    """Whether each step sizes its own tree: ``--budget auto``, or graft's cost-aware tree without a number."""
    return config.budget == "auto" or (config.budget is None and tree_mode(config) == "cost")


def tree_budget(config: MethodConfig, device: str, widest: int | None = None) -> int:
    """Verified tree nodes per step at most, resolved here and nowhere else: the number given, else the device's
    default; a tree sized per step is capped by the widest forward measured (``widest`` rows, root included: the
    latency model's, else the profile's sizes). It also bounds how far past the last accepted token a method
    reaches, in positions and in cache rows."""
    if config.method == "ar":
        return 0
    if sized_per_step(config):
        return (widest or max(defaults_for(device).profile_sizes)) - 1
    return config.budget if config.budget is not None else defaults_for(device).budget


def drafting_for(config: MethodConfig, device: str) -> tuple[DraftSettings, PruneSchedule | None]:
    """The drafting settings with every device default filled in, and the pruning schedule (None for dense:
    the cost-aware tree keeps only the expansion floor, the objective replacing the checkpoints)."""
    given, defaults = config.drafting, defaults_for(device)
    cost = tree_mode(config) == "cost"
    depth = given.depth if given.depth is not None else (MAX_LEVELS if cost else defaults.depth)
    top_k = given.draft_top_k if given.draft_top_k is not None else defaults.draft_top_k
    if depth < 1 or top_k < 1:
        raise GraftError("--depth and --draft-top-k must be at least 1")
    prune = None
    if config.method != "dense":
        schedule = given.prune_at if given.prune_at is not None else ("none" if cost else DEFAULT_SCHEDULE)
        prune = PruneSchedule.parse(schedule, defaults.prune_floor)
    window = given.draft_window if given.draft_window is not None else defaults.draft_window
    settings = replace(given, depth=depth, draft_top_k=top_k, draft_window=window,
                       draft_weights=given.draft_weights or draft_weights_for(device))
    return settings, prune


def draft_weights_for(device: str) -> str:
    """The device's default draft weights, where this torch can run them: FBGEMM's fp16 kernel halves the bytes a
    CPU draft forward reads; a GPU's draft already runs in the model's bf16/fp16."""
    from graft_cli.runtime.half_linear import half_available  # lazy: torch only once a drafter is set up

    weights = defaults_for(device).draft_weights
    return weights if weights != "fp16" or half_available() else "full"


def kinds() -> list[str]:
    """The installed drafter kinds, sorted."""
    return sorted(discovery.discover(discovery.DRAFTERS))


def parse_draft(draft: str) -> tuple[str, str]:
    """``--draft`` to ``(kind, spec)``; one GraftError line for a kind nobody installed or an empty spec."""
    installed = kinds()
    if DEFAULT_KIND not in installed:  # graft's own entry points: missing only from an install older than them
        raise GraftError("graft's built-in drafters are not registered (installed before pyproject.toml declared "
                         "them): reinstall graft (make install, or pip install -e .)")
    kind, colon, spec = draft.partition(":")
    if colon and kind in installed:
        if not spec:
            raise GraftError(f"--draft {draft}: nothing after '{kind}:' (give --draft {kind}:SPEC)")
        return kind, spec
    if colon and _NAME.fullmatch(kind) and not Path(draft).exists():
        close = difflib.get_close_matches(kind, installed, n=1)
        hint = f"; did you mean {close[0]}:{spec}?" if close else ""
        raise GraftError(f"--draft {draft}: unknown drafter kind '{kind}' (installed: {', '.join(installed) or 'none'}"
                         f"{hint}); a draft model is named without a kind, or as model:NAME")
    if not draft.strip():
        raise GraftError("--draft is empty: give a draft model, or KIND:SPEC")
    return DEFAULT_KIND, draft
