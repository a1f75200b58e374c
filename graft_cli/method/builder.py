"""A method's configuration to its proposer: each method is the one GraftProposer (or, for graft with a drafter,
the cost-aware proposer) with some parts switched on, its drafter and retrievers built through their plugins."""

from __future__ import annotations

from dataclasses import replace

from datastores import DatastoreError, read_store, resolve_store
from graft_cli.core import discovery
from graft_cli.catalog import graft_home
from graft_cli.core import defaults_for, Drafter, DrafterEnv, GraftError, Retriever, RetrieverEnv
from graft_cli.drafting import AutoBudget, CostAwareProposer, GraftProposer, LatencyModel, Objective, cap, latency_model
from graft_cli.method.config import (
    MethodConfig, budget_for, check, drafting_for, parse_draft, retrievers_for, tree_mode,
)
from graft_cli.runtime.loading import Loaded

__all__ = ["MethodConfig", "build", "check_datastore", "load_drafter", "make_drafter", "make_retrievers"]


def make_retrievers(names: list[str], env: RetrieverEnv) -> list[Retriever]:
    """Each retriever over ``env`` named as it was asked for, so that ``NAME.KEY`` options reach it; the options
    themselves stay one shared object, which knows what none of them read."""
    return [discovery.build(name, replace(env, name=name)) for name in names]


def load_drafter(kind: str, env: DrafterEnv) -> Drafter:
    """The installed drafter plugin ``kind`` over ``env``: a plugin that is missing or broken is one GraftError."""
    return discovery.build(kind, env, discovery.DRAFTERS)


def make_drafter(config: MethodConfig, loaded: Loaded) -> Drafter:
    """The drafter ``--draft`` names, over the drafting settings with the device's defaults filled in."""
    kind, spec = parse_draft(config.draft)
    settings, prune = drafting_for(config, loaded.device)
    return load_drafter(kind, DrafterEnv(loaded, spec, settings, prune))


def check_datastore(config: MethodConfig) -> None:
    """That ``--datastore`` names a store (its manifests read; kind and tokenizer are checked when it opens)."""
    store = config.options.peek("datastore")
    if store:
        try:
            read_store(resolve_store(store, graft_home()))
        except DatastoreError as e:
            raise GraftError(str(e)) from e


def build(config: MethodConfig, loaded: Loaded, latency: LatencyModel | None = None) -> GraftProposer | AutoBudget:
    """The proposer for ``config`` over the target ``loaded``; ``latency``: the measured verification costs when
    the caller has them (``--budget auto``), else the device's default curve."""
    check(config)
    if config.budget == "auto":
        return _build_auto(config, loaded)
    budget = budget_for(config, loaded.device)
    if config.method == "ar":
        return GraftProposer(0)
    drafter = make_drafter(config, loaded) if config.draft else None
    names = retrievers_for(config)
    env = RetrieverEnv(vocab_size=loaded.model.config.vocab_size, device=loaded.device, tokenizer=loaded.tokenizer,
                       options=config.options)
    retrievers = make_retrievers(names, env)
    tail = config.drafting.chain
    if drafter is not None and tree_mode(config) == "cost":
        return _cost_aware(config, loaded, latency, budget, retrievers, drafter)
    return GraftProposer(budget, retrievers, drafter=drafter, latency=latency or _default_curve(config, loaded),
                         tail=tail)


def _default_curve(config: MethodConfig, loaded: Loaded) -> LatencyModel:
    return LatencyModel.default(config.curve or loaded.device)


def _cost_aware(config: MethodConfig, loaded: Loaded, measured: LatencyModel | None, budget: int,
                retrievers: list[Retriever], drafter: Drafter) -> CostAwareProposer:
    """graft with a drafter: the tree chosen by expected tokens per second, on this model's measured latency
    (measured once per model and device, then cached), unless another device's curve is asked for."""
    latency = measured or _default_curve(config, loaded)
    if measured is None and not config.curve:
        try:
            latency = latency_model(loaded)
        except GraftError:  # a model built in memory has no checksum to file a profile under
            pass
    settings, _ = drafting_for(config, loaded.device)
    objective = Objective(latency, max_levels=settings.depth, planned=defaults_for(loaded.device).planned_draft)
    if config.budget is None:
        budget = cap(latency)  # the objective sizes every tree; the budget is only its ceiling
    return CostAwareProposer(budget, retrievers, drafter=drafter, latency=latency, tail=config.drafting.chain,
                             objective=objective)


def _build_auto(config: MethodConfig, loaded: Loaded) -> GraftProposer | AutoBudget:
    """``--budget auto``: the proposer at a generous cap, on the measured latency model, cut per step by
    :class:`AutoBudget`. Plain decoding (``ar``) has no tree and needs no profile."""
    if config.method == "ar":
        return build(replace(config, budget=0), loaded)
    latency = latency_model(loaded)
    inner = build(replace(config, budget=cap(latency)), loaded, latency)  # its own choices use the same costs
    return AutoBudget(inner, latency)
