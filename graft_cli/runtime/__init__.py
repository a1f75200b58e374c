"""The model layer: loading a model, its KV cache and attention, one forward per step, and the decoding loop.

What graft_cli.plugin hands a drafter plugin from here: ``Target`` (a model's prefill, tree forward and cache
compaction), ``load_model`` and ``Loaded``, the CPU kernels (``half_copy``, ``half_available``), and the token ranking.
"""

from graft_cli.runtime import loading, token_ranking
from graft_cli.runtime.cpu_linear import CpuLinear, use_cpu_linears
from graft_cli.runtime.engine import decode
from graft_cli.runtime.graphs import Capture
from graft_cli.runtime.half_linear import HalfLinear, half_available, half_copy, to_half
from graft_cli.runtime.loading import Loaded, load_model
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Forward, Rule, Target, on

__all__ = ["Capture", "CpuLinear", "Forward", "HalfLinear", "Loaded", "Rule", "Sampling", "Target", "decode",
           "half_available", "half_copy", "load_model", "loading", "on", "to_half", "token_ranking", "use_cpu_linears"]
