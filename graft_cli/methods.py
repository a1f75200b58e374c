"""Method names to proposers: each method is the one GraftProposer with some parts switched on."""

from __future__ import annotations

from dataclasses import dataclass, field

from graft_cli.budget import LatencyModel
from graft_cli.errors import GraftError
from graft_cli.graft import GraftProposer
from plugins import load_factory
from plugins.base import RetrieverEnv

# method -> retrievers it uses by default (drafter methods are added with the drafters)
RETRIEVERS = {"ar": [], "pld": ["prompt"]}
METHODS = tuple(RETRIEVERS)


@dataclass
class MethodConfig:
    method: str = "ar"
    budget: int | str | None = None  # verification nodes per step; None: the device's default; "auto": measured
    retrievers: list[str] | None = None  # None: the method's default list
    options: dict[str, str] = field(default_factory=dict)  # retriever options, e.g. datastore=...
    draft: str | None = None  # draft model spec, or eagle3:DIR


def default_budget(device: str) -> int:
    """CPUs pay for every verified token; GPUs verify dozens for the price of one."""
    return 60 if device.startswith("cuda") else 16


def make_retrievers(names: list[str], env: RetrieverEnv) -> list:
    retrievers = []
    for name in names:
        try:
            retrievers.append(load_factory(name)(env))
        except (LookupError, ImportError, ValueError) as e:
            raise GraftError(str(e)) from e
    return retrievers


def build(config: MethodConfig, loaded) -> GraftProposer:
    """The proposer for ``config`` over the target ``loaded`` (a graft_cli.loading.Loaded)."""
    if config.method not in RETRIEVERS:
        raise GraftError(f"unknown method '{config.method}' (choose from {', '.join(METHODS)})")
    if config.budget == "auto":  # measured latency, tree size chosen per step (graft_cli/profile.py)
        from graft_cli.profile import build_auto

        return build_auto(config, loaded, build)
    device = loaded.device
    budget = config.budget if config.budget is not None else default_budget(device)
    if config.method == "ar":
        return GraftProposer(0)
    names = config.retrievers if config.retrievers is not None else RETRIEVERS[config.method]
    env = RetrieverEnv(
        vocab_size=loaded.model.config.vocab_size, device=device, tokenizer=loaded.tokenizer, options=config.options
    )
    return GraftProposer(budget, make_retrievers(names, env), latency=LatencyModel.default(device))
