"""graft's vocabulary: the types every part speaks (a plugin gets them from graft_cli.plugin, which re-exports them).

Nothing here imports torch, a model, the command line or a plugin, so it is cheap to import and sits below
every other layer (docs/architecture.md, "Layers").
"""

from graft_cli.core.calibration import Calibration
from graft_cli.core.defaults import DeviceDefaults, defaults_for, device_kind
from graft_cli.core.env import DrafterEnv, DraftSettings, LoadedModel, Options, RetrieverEnv, Shapes
from graft_cli.core.errors import GraftError
from graft_cli.core.protocols import Drafter, DrafterDefaults, Needs, Proposer, Queue, Retriever, RetrieverDefaults, complete
from graft_cli.core.prune import DEFAULT_SCHEDULE, Checkpoint, PruneSchedule
from graft_cli.core.stats import Stats
from graft_cli.core.step import Outcome, Step
from graft_cli.core.timing import Clock, Recorder
from graft_cli.core.tree import ROOM, ROOT, Node, Tree, best_first

__all__ = [
    "Calibration", "Checkpoint", "Clock", "DEFAULT_SCHEDULE", "DeviceDefaults", "Drafter", "DrafterDefaults", "DrafterEnv", "DraftSettings",
    "GraftError", "LoadedModel", "Needs", "Node", "Options", "Outcome", "Proposer", "PruneSchedule", "Queue", "ROOM",
    "ROOT", "Recorder", "Retriever", "RetrieverDefaults", "RetrieverEnv", "Shapes", "Stats", "Step", "Tree", "best_first",
    "complete", "defaults_for", "device_kind",
]
