"""Method names to proposers: each method is the one GraftProposer with some parts switched on.

| method | drafter | pruning | retrievers (default) |
|---|---|---|---|
| ar | - | - | - |
| pld | - | - | prompt |
| recycling | - | - | recycling (Token Recycling's adjacency table) |
| rest | - | - | suffix-array (REST: the --datastore alone) |
| dense | --draft (required) | - | - (the EAGLE-2/3 baseline: the draft fills the whole budget) |
| pruned | --draft (required) | --prune-at | - |
| graft | --draft (optional) | --prune-at | prompt, recycling (+ suffix-array with --datastore) |

graft with a drafter builds its tree by cost (``--tree cost``, graft_cli/objective.py): retrieval first, the
retrieved chain checked in the draft's first forward, draft levels only while they raise the expected tokens per
second (up to ``--depth``, 24 by default), pruning checkpoints replaced by that rule (the expansion floor stays).
``--tree fixed`` keeps the table's fixed depth and checkpoints.

``--chain`` makes the drafter draft one path; with ``graft`` that is Graft(TAIL): the confident prefix of the
chain is kept and the rest of the budget is filled with retrieved tokens, from the root and after the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graft_cli.budget import DEFAULT_LATENCY, LatencyModel
from graft_cli.errors import GraftError
from graft_cli.graft import GraftProposer
from graft_cli.objective import MAX_LEVELS, Objective
from graft_cli.prune import DEFAULT as DEFAULT_PRUNE
from graft_cli.prune import PruneSchedule, default_floor
import plugins
from plugins.base import Options, RetrieverEnv

STORE_RETRIEVER = "suffix-array"  # joins graft's defaults when a --datastore is given
# method -> retrievers it uses by default
RETRIEVERS = {
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


@dataclass
class MethodConfig:
    method: str = "graft"
    budget: int | str | None = None  # verification nodes per step; None: the device's default; "auto": measured
    retrievers: list[str] | None = None  # None: the method's default list
    options: Options = field(default_factory=Options)  # retriever options, e.g. datastore=...
    draft: str | None = None  # --draft: a draft model, or KIND:SPEC of a graft.drafters plugin (eagle3:DIR, ...)
    depth: int | None = None  # draft levels at most; None: the device's default
    draft_top_k: int | None = None  # children per expanded node and nodes expanded per level
    prune_at: str | None = None  # "LEVEL:THRESHOLD[:SHARE],...[,floor:X]"; None: (0.35, 0.25, 0.15), device floor
    chain: bool = False  # draft one path (Graft(TAIL) with graft)
    rope_theta: float | None = None  # EAGLE-3 heads: the RoPE base the head was trained with
    draft_vocab: int | None = None  # draft models: score N ranked ids + special + the prompt's (0: all; None: default)
    draft_window: int | None = None  # draft models: prompt tokens read at most (None: the device's default; 0: all)
    draft_weights: str | None = None  # draft models: "fp16" or "full" (None: the device's default)
    tree: str | None = None  # "cost" (graft's default with a drafter: graft_cli/objective.py) or "fixed"
    curve: str | None = None  # "cpu" or "cuda": choose trees by that device's default latency curve, not this one's

    def __post_init__(self) -> None:
        if not isinstance(self.options, Options):  # a plain dict from a caller: the same keys, reads now counted
            self.options = Options(self.options)


def default_budget(device: str) -> int:
    """CPUs pay for every verified token; GPUs verify dozens for the price of one."""
    return 60 if device.startswith("cuda") else 16


MIN_WINDOW = 64  # a draft window this short would leave the draft almost nothing to read


def default_draft_window(device: str) -> int:
    """A CPU pays for a draft model's prefill of a long prompt in full before the first token; a GPU hardly."""
    return 0 if device.startswith("cuda") else 2048


DRAFT_WEIGHTS = ("fp16", "full")


def default_draft_weights(device: str) -> str:
    """A CPU's draft forward costs the bytes of its weights, and FBGEMM's fp16 kernel halves them (measured: about
    half the time of a 0.5B Qwen's forward); a GPU's draft already runs in the model's bf16/fp16."""
    from graft_cli.half_linear import half_available

    return "fp16" if device.startswith("cpu") and half_available() else "full"


def default_depth(device: str) -> int:
    return 7 if device.startswith("cuda") else 8


def default_draft_top_k(device: str) -> int:
    """A GPU verifies a wide tree for the price of one token; a CPU pays for every verified row, so more
    candidates per level buy little there (the Qwen pair, coding and math: top-k 4 ran 1.76x where 2 ran 1.79x,
    although a draft forward's extra rows cost only a few percent: docs/benchmarks.md)."""
    return 8 if device.startswith("cuda") else 2


def make_retrievers(names: list[str], env: RetrieverEnv) -> list:
    return [plugins.build(name, env) for name in names]


def check(config: MethodConfig) -> None:
    """What can be checked before the model loads: the method and its flags."""
    method = config.method
    if method not in RETRIEVERS:
        raise GraftError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if method in NEEDS_DRAFT and not config.draft:
        raise GraftError(f"--method {method} needs a drafter: --draft MODEL or --draft eagle3:DIR")
    if config.draft and method not in TAKES_DRAFT:
        raise GraftError(f"--method {method} does not use a drafter (use dense, pruned or graft with --draft)")
    if config.draft:
        from graft_cli.drafters.registry import parse_draft

        parse_draft(config.draft)  # an unknown KIND: fails here, before the model loads
    if method == "rest" and not config.options.peek("datastore"):
        raise GraftError("--method rest retrieves from a datastore: give --datastore NAME_OR_PATH")
    if config.chain and not config.draft:
        raise GraftError("--chain needs a drafter (--draft)")
    if config.prune_at is not None and method == "dense":
        raise GraftError("--prune-at prunes the draft tree: use --method pruned or graft, not dense")
    if config.draft_window is not None and (config.draft_window < 0 or 0 < config.draft_window <= MIN_WINDOW):
        raise GraftError(f"--draft-window must be 0 (the whole prompt) or more than {MIN_WINDOW} tokens")
    if config.draft_weights not in (None, *DRAFT_WEIGHTS):
        raise GraftError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got '{config.draft_weights}'")
    if config.tree not in (None, "cost", "fixed"):
        raise GraftError(f"--tree must be 'cost' or 'fixed', got '{config.tree}'")
    if config.curve is not None and config.curve not in DEFAULT_LATENCY:
        raise GraftError(f"curve={config.curve}: choose trees by one of {', '.join(DEFAULT_LATENCY)}'s latency curves")
    if config.tree == "cost" and (method != "graft" or not config.draft):
        raise GraftError("--tree cost chooses a drafter's tree: it needs --method graft and --draft")


def tree_mode(config: MethodConfig) -> str:
    """graft with a drafter builds its tree by cost unless told otherwise; every other method's is fixed."""
    if config.tree is not None:
        return config.tree
    return "cost" if config.method == "graft" and config.draft else "fixed"


def check_datastore(config: MethodConfig) -> None:
    """That ``--datastore`` names a store (its manifests read; kind and tokenizer are checked when it opens)."""
    store = config.options.peek("datastore")
    if store:
        from datastores import DatastoreError, read_store, resolve_store
        from graft_cli.catalog.home import graft_home

        try:
            read_store(resolve_store(store, graft_home()))
        except DatastoreError as e:
            raise GraftError(str(e)) from e


def build(config: MethodConfig, loaded, latency: LatencyModel | None = None) -> GraftProposer:
    """The proposer for ``config`` over the target ``loaded`` (a graft_cli.loading.Loaded); ``latency``: the
    measured verification costs when the caller has them (``--budget auto``), else the device's default."""
    check(config)
    method = config.method
    if config.budget == "auto":  # measured latency, tree size chosen per step (graft_cli/profile.py)
        from graft_cli.profile import build_auto

        return build_auto(config, loaded, build)
    device = loaded.device
    budget = config.budget if config.budget is not None else default_budget(device)
    if budget < 0:
        raise GraftError("--budget must be >= 0")
    if method == "ar":
        return GraftProposer(0)
    drafter = None
    if config.draft:
        from graft_cli.drafters import registry

        cost = tree_mode(config) == "cost"
        depth = config.depth if config.depth is not None else (MAX_LEVELS if cost else default_depth(device))
        top_k = config.draft_top_k if config.draft_top_k is not None else default_draft_top_k(device)
        if depth < 1 or top_k < 1:
            raise GraftError("--depth and --draft-top-k must be at least 1")
        prune = None
        if method != "dense":  # the cost-aware tree keeps the expansion floor; the objective replaces checkpoints
            default = "none" if cost else DEFAULT_PRUNE
            prune = PruneSchedule.parse(config.prune_at if config.prune_at is not None else default,
                                        default_floor(device))
        kind, spec = registry.parse_draft(config.draft)
        window = config.draft_window if config.draft_window is not None else default_draft_window(device)
        weights = config.draft_weights or default_draft_weights(device)
        env = registry.DrafterEnv(loaded, spec, depth, top_k, prune, config.chain, config.rope_theta, config.draft_vocab,
                                  window, weights)
        drafter = registry.load_drafter(kind, env)
    names = config.retrievers if config.retrievers is not None else list(RETRIEVERS[method])
    if config.retrievers is None and method == "graft" and config.options.peek("datastore"):
        names.append(STORE_RETRIEVER)
    env = RetrieverEnv(
        vocab_size=loaded.model.config.vocab_size, device=device, tokenizer=loaded.tokenizer, options=config.options
    )
    measured, objective = latency, None
    latency = latency or LatencyModel.default(config.curve or device)
    if drafter is not None and tree_mode(config) == "cost":
        from graft_cli.profile import cap, latency_model

        try:  # measured once per model and device, then cached (unless another device's curve is asked for)
            latency = measured or (latency if config.curve else latency_model(loaded))
        except GraftError:  # a model built in memory has no checksum to file a profile under
            pass
        # off the CPU a read of the device stalls its queue: the depth is planned before each draft
        objective = Objective(latency, max_levels=depth, planned=not str(device).startswith("cpu"))
        if config.budget is None:
            budget = cap(latency)  # the objective sizes every tree; the budget is only its ceiling
    return GraftProposer(budget, make_retrievers(names, env), drafter=drafter, latency=latency, tail=config.chain,
                         objective=objective)
