"""graft's plugin surface: every name a retriever or a drafter plugin needs, in one module that stays put.

A plugin imports from here and nowhere else in graft_cli (graft's own built-ins in ``plugins/`` do the same). The
modules these names live in may move; this module's names keep their meaning for as long as ``API_VERSION``'s
major number stays, and a new name raises only the minor one. docs/plugins.md is the full manual.

Retrievers (cheap: importing this module loads neither torch nor transformers)
    ``Tree``, ``Node``, ``ROOT``: the scored candidates a retriever returns; ``Step``: what a verification
    appended; ``Retriever`` and ``RetrieverDefaults``: the protocol and its optional members; ``RetrieverEnv``:
    what a factory is given; ``option``: a retriever's ``--retriever-opt`` value; ``Calibration``: scores
    corrected per kind of lookup; ``GraftError``: the one-line error a user sees; ``graft_home``: where graft
    keeps models and datastores (imported on first use: it brings ``datastores``).

Drafters
    Cheap like the above: ``Drafter`` and ``DrafterDefaults`` (the protocol, and the members a drafter without a
    model of its own leaves to it), ``Needs`` (what it needs of each step), ``Outcome`` (a step's result still on
    the device), ``Recorder`` (the clock and counters its proposer hands it), ``DrafterEnv``, ``DraftSettings``,
    ``Shapes``, ``LoadedModel``, ``PruneSchedule``, ``Stats``, ``defaults_for``. Imported on first use, since they
    need torch: ``TreeDrafter`` (the EAGLE-2 expansion loop), ``positions``, ``Objective``, the fixed-shape levels
    (``FixedLevels``, ``head_catch_up``, ``head_level``, ``model_catch_up``, ``model_level``,
    ``kernels_outside``), the model layer (``load_model``, ``Loaded``, ``Target``, ``Capture``, ``on``), the CPU
    kernels (``CpuLinear``,
    ``use_cpu_linears``, ``HalfLinear``, ``half_available``, ``half_copy``, ``to_half``), the token ranking
    (``Ranking``, ``load_ranking``, ``RANKING_COVERAGE``) and EAGLE-3 heads (``Eagle3Head``, ``load_head``,
    ``head_layers``, ``resolve_head``).

A plugin that relies on this surface's shape says which major version it was written for, once, at import:
``require_api(1)``; under another major version it fails to load with one line that says why.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable

from graft_cli.core import (
    ROOT, Calibration, Drafter, DrafterDefaults, DrafterEnv, DraftSettings, GraftError, LoadedModel, Needs, Node,
    Outcome, PruneSchedule, Recorder, Retriever, RetrieverDefaults, RetrieverEnv, Shapes, Stats, Step, Tree,
    defaults_for,
)
from graft_cli.core.version import __version__

if TYPE_CHECKING:
    from graft_cli.runtime.loading import Loaded

API_VERSION = (1, 1)  # (major, minor): a removed or changed name raises the major, a new name the minor

_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _lazy(module: str, *names: str) -> dict[str, tuple[str, str]]:
    """``names`` of ``module`` under their own names: a module's list, not one entry a name."""
    return {name: (module, name) for name in names}


# public name -> (module, attribute), imported when first asked for: a retriever never pays for torch
_LAZY: dict[str, tuple[str, str]] = {
    **_lazy("graft_cli.catalog", "graft_home"),
    **_lazy("graft_cli.drafting", "FixedLevels", "Objective", "TreeDrafter", "head_catch_up", "head_level",
            "kernels_outside", "model_catch_up", "model_level", "positions"),
    **_lazy("graft_cli.runtime", "Capture", "CpuLinear", "HalfLinear", "Loaded", "Target",
            "half_available", "half_copy", "on", "to_half", "use_cpu_linears"),
    **_lazy("graft_cli.heads", "Eagle3Head", "head_layers", "load_head", "resolve_head"),
    "Ranking": ("graft_cli.runtime.token_ranking", "Ranking"),
    "load_ranking": ("graft_cli.runtime.token_ranking", "load"),
    "RANKING_COVERAGE": ("graft_cli.runtime.token_ranking", "COVERAGE"),
}

__all__ = [
    "API_VERSION", "Calibration", "Drafter", "DrafterDefaults", "DrafterEnv", "DraftSettings", "GraftError",
    "LoadedModel", "Needs", "Node", "Outcome", "PruneSchedule", "ROOT", "Recorder", "Retriever", "RetrieverDefaults",
    "RetrieverEnv", "Shapes", "Stats", "Step", "Tree", "defaults_for", "load_model", "option", "require_api",
    *sorted(_LAZY),
]


def require_api(major: int, minor: int = 0) -> None:
    """Refuse, in one line, to run under a plugin API this plugin was not written for: another major version, or
    an older minor one than the names it uses. Call it at the top of the plugin's module."""
    if major == API_VERSION[0] and minor <= API_VERSION[1]:
        return
    hint = "upgrade graft" if (major, minor) > API_VERSION else "this plugin is older than graft: update the plugin"
    raise GraftError(f"needs graft's plugin API {major}.{minor} (or a later {major}.x); graft {__version__} has "
                     f"{API_VERSION[0]}.{API_VERSION[1]}: {hint}")


def option(env: RetrieverEnv, key: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    """The retriever's option ``key`` (``--retriever-opt``, strings): ``NAME.KEY`` (``NAME``: what the retriever is
    installed as, ``env.name``) wins over the plain ``KEY``, which every retriever reading ``KEY`` shares (so
    ``--datastore``, which arrives as ``datastore``); absent or empty, ``default``. ``cast`` reads the string; with
    ``bool`` it takes 1/true/yes/on and 0/false/no/off. A value it cannot read is one GraftError line."""
    options = env.options or {}
    given = [options.get(f"{env.name}.{key}") if env.name else None, options.get(key)]  # both count as read
    raw = next((value for value in given if value not in (None, "")), None)
    if raw is None:
        return default
    try:
        return _FLAGS[str(raw).lower()] if cast is bool else cast(raw)
    except (KeyError, TypeError, ValueError):
        raise GraftError(f"retriever {env.name or '?'}: option {key} must be a {cast.__name__}, not {raw!r}") from None


def load_model(spec: str, device: str = "auto", dtype: str = "auto") -> Loaded:
    """A model and its tokenizer from a catalog name, a path or a hub id, as graft loads its target. Looked up at
    each call, not once: ``graft bench`` hands every method the one copy of a model it loaded."""
    from graft_cli.runtime import loading  # lazy: torch loads with a drafter's first model, never for a retriever

    return loading.load_model(spec, device, dtype)


def __getattr__(name: str) -> Any:
    """A drafter's name (or ``graft_home``), imported the first time it is asked for and kept."""
    if name not in _LAZY:
        raise AttributeError(f"module 'graft_cli.plugin' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = globals()[name] = getattr(import_module(module), attribute)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
