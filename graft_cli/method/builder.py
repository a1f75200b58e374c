"""A method's configuration to its proposer: each method is the one GraftProposer (or, for graft with a drafter,
the cost-aware proposer) with some parts switched on, its drafter and retrievers built through their plugins."""

from __future__ import annotations

from dataclasses import replace

from datastores import DatastoreError, read_store, resolve_store
from graft_cli.core import discovery
from graft_cli.catalog import graft_home
from graft_cli.core import defaults_for, Drafter, DrafterEnv, GraftError, Proposer, Recorder, Retriever, RetrieverEnv
from graft_cli.drafting import AutoBudget, CostAwareProposer, GraftProposer, LatencyModel, Objective, latency_model
from graft_cli.models.four_bit import precision
from graft_cli.method.config import (
    MethodConfig, check, drafting_for, parse_draft, retrievers_for, sized_per_step, tree_budget, tree_mode,
)
from graft_cli.runtime.fixed_target import drafter_shapes
from graft_cli.runtime.loading import Loaded
from graft_cli.runtime.target import Target

__all__ = ["MethodConfig", "build", "check_datastore", "load_drafter", "make_drafter", "make_retrievers"]


def make_retrievers(names: list[str], env: RetrieverEnv) -> list[Retriever]:
    """Each retriever over ``env`` named as it was asked for, so that ``NAME.KEY`` options reach it; the options
    themselves stay one shared object, which knows what none of them read."""
    return [discovery.build(name, replace(env, name=name)) for name in names]


def load_drafter(kind: str, env: DrafterEnv) -> Drafter:
    """The installed drafter plugin ``kind`` over ``env``: a plugin that is missing or broken is one GraftError."""
    return discovery.build(kind, env, discovery.DRAFTERS)


def make_drafter(config: MethodConfig, loaded: Loaded, target: Target | None = None) -> Drafter:
    """The drafter ``--draft`` names, over the drafting settings with the device's defaults filled in, its levels
    at fixed shapes when ``target``'s steps are."""
    kind, spec = parse_draft(config.draft)
    settings, prune = drafting_for(config, loaded.device)
    shapes = None if target is None else drafter_shapes(target)
    return load_drafter(kind, DrafterEnv(loaded, spec, settings, prune, shapes))


def check_datastore(config: MethodConfig) -> None:
    """That ``--datastore`` names a store (its manifests read; kind and tokenizer are checked when it opens)."""
    store = config.options.peek("datastore")
    if store:
        try:
            read_store(resolve_store(store, graft_home()))
        except DatastoreError as e:
            raise GraftError(str(e)) from e


def build(config: MethodConfig, loaded: Loaded, target: Target | None = None,
          recorder: Recorder | None = None) -> Proposer:
    """The proposer for ``config`` over the target ``loaded``: the one builder of a method, whoever runs it (the
    API and so ``generate`` and ``serve``, ``graft bench``, the scripts). Its drafter follows ``target``'s fixed
    shapes; ``recorder``: its clock and counters (a fresh one on the wall clock by default)."""
    check(config)
    recorder = recorder or Recorder()
    if config.method == "ar":
        return GraftProposer(0, recorder=recorder)
    latency = _latency(config, loaded)
    budget = tree_budget(config, loaded.device, max(latency.points) if sized_per_step(config) else None)
    drafter = make_drafter(config, loaded, target) if config.draft else None
    env = RetrieverEnv(vocab_size=loaded.model.config.vocab_size, device=loaded.device, tokenizer=loaded.tokenizer,
                       options=config.options)
    retrievers = make_retrievers(retrievers_for(config), env)
    tail = config.drafting.chain
    if drafter is not None and tree_mode(config) == "cost":
        settings, _ = drafting_for(config, loaded.device)
        objective = Objective(latency, max_levels=settings.depth, planned=defaults_for(loaded.device).planned_draft)
        proposer: Proposer = CostAwareProposer(budget, retrievers, drafter=drafter, latency=latency, tail=tail,
                                               objective=objective, recorder=recorder)
    else:
        proposer = GraftProposer(budget, retrievers, drafter=drafter, latency=latency, tail=tail, recorder=recorder)
    return AutoBudget(proposer, latency) if config.budget == "auto" else proposer


def _latency(config: MethodConfig, loaded: Loaded) -> LatencyModel:
    """What a verification costs, as the method chooses its trees by: measured on this model and device (once,
    then cached) for ``--budget auto``, graft's cost-aware tree (unless another device's curve is asked for) and
    a model in 4 bits, whose kernel prices rows far above the device's default curve (a 9-row forward 2x a
    one-row one, graft_cli/models/four_bit.py); else the device's default curve."""
    default = LatencyModel.default(config.curve or loaded.device)
    if config.budget == "auto" or precision(loaded.model) == "q4":
        return latency_model(loaded)
    if config.draft and tree_mode(config) == "cost" and not config.curve:
        try:
            return latency_model(loaded)
        except GraftError:  # a model built in memory has no checksum to file a profile under
            pass
    return default
