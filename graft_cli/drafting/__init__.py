"""Drafting and retrieval policy: how a step's tree is grown, pruned, grafted and sized.

The public names here are what graft_cli.plugin hands a drafter plugin (``TreeDrafter``) and what the method
configuration assembles (the proposers and their cost models).
"""

from graft_cli.drafting.budget import LatencyModel
from graft_cli.drafting.cost_aware import CostAwareProposer
from graft_cli.drafting.fixed_levels import (FixedLevels, head_catch_up, head_level, kernels_outside, model_catch_up,
                                             model_level)
from graft_cli.drafting.objective import Objective
from graft_cli.drafting.profile import AutoBudget, latency_model
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.drafting.pool import positions
from graft_cli.drafting.tree_drafter import TreeDrafter

__all__ = ["AutoBudget", "CostAwareProposer", "FixedLevels", "GraftProposer", "LatencyModel", "MAX_LEVELS",
           "Objective", "TreeDrafter", "head_catch_up", "head_level", "kernels_outside", "latency_model",
           "model_catch_up", "model_level", "positions"]
