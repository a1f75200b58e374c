"""graft's vocabulary: the types every part speaks (a plugin gets them from graft_cli.plugin, which re-exports them).

Nothing here imports torch, a model, the command line or a plugin, so it is cheap to import and sits below
every other layer (docs/architecture.md, "Layers").
"""

from graft_cli.core.calibration import Calibration
from graft_cli.core.defaults import DeviceDefaults, defaults_for, device_kind
from graft_cli.core.env import DrafterEnv, DraftSettings, LoadedModel, Options, RetrieverEnv
from graft_cli.core.errors import GraftError
from graft_cli.core.protocols import Drafter, Proposer, Retriever, RetrieverDefaults, complete
from graft_cli.core.prune import DEFAULT_SCHEDULE, Checkpoint, PruneSchedule
from graft_cli.core.stats import Stats, Stopwatch
from graft_cli.core.step import Step
from graft_cli.core.tree import ROOM, ROOT, Node, Tree, best_first

__all__ = [
    "Calibration", "Checkpoint", "DEFAULT_SCHEDULE", "DeviceDefaults", "Drafter", "DrafterEnv", "DraftSettings", "GraftError", "LoadedModel", "Node", "Options",
    "Proposer", "PruneSchedule", "ROOM", "ROOT", "Retriever", "RetrieverDefaults", "RetrieverEnv", "Stats", "Step", "Stopwatch",
    "Tree", "best_first", "complete", "defaults_for", "device_kind",
]
