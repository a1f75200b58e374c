"""Device discipline of the decoding hot path, checked on a CPU as if a GPU were watching.

Statically (an AST walk): every torch tensor constructor in the hot-path modules names its ``device=``, or its
line says ``# host`` (deliberately host-side, e.g. a load-time check). Dynamically (a TorchFunctionMode while
drafts run on tiny models): the checked code makes no tensor without an explicit device, makes no hidden
synchronisation (``nonzero``, boolean indexing, ...), and reads the device back once per draft, plus once per
level where a stop decision is really open (a checkpoint, the expansion floor, a pool that may be settled).

``HOT_PATH`` and ``DYNAMIC_SCOPE`` are the lists to extend as more modules are held to this.
"""

from __future__ import annotations

import ast
import linecache
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from plugins.draft_model import DraftModelDrafter
from graft_cli.heads import load_head
from plugins.eagle3 import Eagle3Drafter
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import drafter_shapes
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.drafting import CostAwareProposer, LatencyModel, Objective
from graft_cli.core import PruneSchedule
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.test_eagle3 import target_model, write_head
from tests.tiny import VOCAB, tiny_model

ROOT = Path(__file__).resolve().parent.parent
HOT_PATH = [
    "graft_cli/runtime/engine.py", "graft_cli/runtime/target.py", "graft_cli/runtime/verify.py", "graft_cli/runtime/sampling.py", "graft_cli/core/tree.py",
    "graft_cli/drafting/proposer.py", "graft_cli/drafting/cost_aware.py", "graft_cli/drafting/budget.py",
    "graft_cli/drafting/tree_drafter.py", "graft_cli/drafting/pool.py", "graft_cli/drafting/stop.py", "plugins/draft_model.py",
    "plugins/eagle3.py", "plugins/adjacency.py", "plugins/prompt_lookup.py", "plugins/store_retriever.py",
    "graft_cli/runtime/fixed_shapes.py", "graft_cli/runtime/device_accept.py", "graft_cli/runtime/fixed_target.py",
    "graft_cli/runtime/graphs.py", "graft_cli/drafting/fixed_levels.py",
]
DYNAMIC_SCOPE = ("graft_cli/drafting/", "plugins/draft_model.py", "plugins/eagle3.py")  # files whose calls the dynamic check holds to the rules
FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "full", "empty", "empty_strided", "arange",
             "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "scalar_tensor",
             "tril_indices", "triu_indices"}  # *_like and Tensor.new_* inherit their device: fine
READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
HIDDEN_SYNCS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "histc"}


def unplaced(source: str) -> list[str]:
    """``line: code`` of every ``torch.<factory>(...)`` without ``device=`` and without ``# host`` on its line;
    ``torch.from_numpy(a).to(device)`` (it takes no device) counts as placed."""
    lines = source.splitlines()
    tree = ast.parse(source)
    moved = {id(node.func.value) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords) or (node.func.attr == "from_numpy" and id(node) in moved):
            continue
        if any("# host" in lines[i - 1] for i in (node.lineno, node.end_lineno)):
            continue
        out.append((node.lineno, f"{node.lineno}: {lines[node.lineno - 1].strip()}"))
    return [text for _, text in sorted(out)]


@pytest.mark.parametrize("module", HOT_PATH)
def test_every_tensor_is_made_on_its_device(module):
    assert unplaced((ROOT / module).read_text()) == []


def test_the_static_check_sees_what_it_should():
    bad = "import torch\nx = torch.tensor([1])\ny = torch.zeros(3, dtype=torch.bool).tril()\nz = torch.from_numpy(a)\n"
    good = ("import torch\nx = torch.tensor([1], device=d)\ny = torch.arange(3)  # host: a load-time check\n"
            "z = torch.from_numpy(a).to(d)\nw = torch.zeros_like(x)\n")
    assert [line.split(":")[0] for line in unplaced(bad)] == ["2", "3", "4"]
    assert unplaced(good) == []


class Discipline(TorchFunctionMode):
    """Raises on a factory call without ``device=`` (unless its line says ``# host``) or a hidden sync from a file
    in ``scope``; counts that code's device-to-host reads. ``strict=False`` only counts (to measure old code)."""

    def __init__(self, scope: tuple[str, ...] = DYNAMIC_SCOPE, strict: bool = True) -> None:
        super().__init__()
        self.scope, self.strict, self.reads = scope, strict, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        indexing = name in ("__getitem__", "__setitem__")
        if name in FACTORIES or name in READS or name in HIDDEN_SYNCS or indexing:
            frame = sys._getframe(1)
            while frame is not None and "/site-packages/torch/" in frame.f_code.co_filename.replace("\\", "/"):
                frame = frame.f_back  # torch's own Python layers: the caller is further out
            where = frame.f_code.co_filename.replace("\\", "/") if frame is not None else ""
            if any(part in where for part in self.scope) and (self.strict or name in READS):
                line = f"{where.split('/')[-1]}:{frame.f_lineno}"
                if name in FACTORIES and kwargs.get("device") is None \
                        and "# host" not in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                    raise AssertionError(f"{line}: torch.{name} without device=")
                if name in HIDDEN_SYNCS or (indexing and _bool_index(args[1])):
                    raise AssertionError(f"{line}: {name} synchronises with the device")
                if name in READS:
                    self.reads += 1
        return func(*args, **kwargs)


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def decode_reading(target, proposer, prompt: list[int], sampling: Sampling, n: int, stops: set[int] = frozenset(),
                   seed: int | None = None) -> tuple[list[int], list[int]]:
    """Decode with graft's and the plugins' device reads counted: the tokens, and the reads of the prefill (with
    the proposer's start), then of each step."""
    mode, reads = Discipline(scope=("graft_cli/", "plugins/"), strict=False), [0]
    steps = decode(target, proposer, prompt, sampling, n, set(stops), seed)
    with mode:
        got = list(next(steps))
        reads.append(mode.reads)
        for new in steps:
            got += new
            reads.append(mode.reads)
    return got, np.diff(reads).tolist()


def following(proposer, target):
    """``proposer`` with its drafter's levels on ``target``'s fixed shapes, as the method builder makes them."""
    shapes = drafter_shapes(target)
    if shapes is not None:
        proposer.drafter.fix_levels(shapes.capture)
    return proposer


def draft_model_proposer(method: str, budget: int, depth: int = 5, top_k: int = 3,
                         objective: Objective | None = None) -> GraftProposer:
    prune = None if method == "dense" else PruneSchedule.parse("0:0.3,1:0.2,3:0.1", floor=0.02)
    drafter = DraftModelDrafter(tiny_model("llama", seed=1), VOCAB, depth, top_k, prune)
    retrievers = [PromptLookup(), AdjacencyRetriever(VOCAB)] if method == "graft" else []
    if objective is not None:
        return CostAwareProposer(budget, retrievers, drafter, objective.latency, objective)
    return GraftProposer(budget, retrievers, drafter=drafter)


def eagle3_proposer(tmp_path: Path, target, budget: int) -> GraftProposer:
    head = load_head(str(write_head(tmp_path / "h", target, seed=1)), target)
    prune = PruneSchedule.parse("0:0.3,1:0.2", floor=0.02)
    return GraftProposer(budget, [PromptLookup()], drafter=Eagle3Drafter(head, target, depth=4, top_k=3, prune=prune))


def drafts_under_discipline(target, proposer: GraftProposer, tokens: int = 30) -> list[tuple[int, int]]:
    """Decode under :class:`Discipline`; (reads, levels) of every draft."""
    mode, per_draft = Discipline(), []
    drafter = proposer.drafter
    inner = drafter.draft

    def draft(context, budget, *args, **kwargs):
        before = mode.reads
        tree = inner(context, budget, *args, **kwargs)
        per_draft.append((mode.reads - before, drafter.levels))
        return tree

    drafter.draft = draft
    prompt = np.random.default_rng(0).integers(0, VOCAB, 10).tolist()
    with mode:
        for _ in decode(Target(target), proposer, prompt + prompt[:5], Sampling(), tokens, set(), None):
            pass
    assert per_draft
    return per_draft


@pytest.mark.parametrize("method", ["dense", "pruned", "graft"])
def test_draft_model_drafting_stays_on_the_device(method):
    per_draft = drafts_under_discipline(tiny_model("llama", seed=1), draft_model_proposer(method, budget=20))
    assert all(reads <= levels + 1 for reads, levels in per_draft)  # one per level at most, and the last


def test_eagle3_drafting_stays_on_the_device(tmp_path):
    target = target_model(seed=2)
    per_draft = drafts_under_discipline(target, eagle3_proposer(tmp_path, target, budget=12))
    assert all(reads <= levels + 1 for reads, levels in per_draft)


def test_a_planned_cost_aware_draft_reads_the_device_once():
    """Off the CPU the cost-aware builder plans each draft's depth from the last one's walk: the levels, the
    pool's best at each, the selected tree and the fed rows all come back in the draft's one read."""
    objective = Objective(LatencyModel.default("cpu"), max_levels=5, planned=True)
    proposer = draft_model_proposer("graft", budget=20, objective=objective)
    per_draft = drafts_under_discipline(tiny_model("llama", seed=1), proposer)
    assert [reads for reads, _ in per_draft] == [1] * len(per_draft)
    assert max(levels for _, levels in per_draft) > 1


def test_a_dense_draft_that_cannot_settle_reads_the_device_once():
    """No checkpoint, no floor, and a budget above the whole pool (3 + 4 levels x 9 = 39 < 40): nothing to decide
    on the way, so the selected tree and the fed rows come back in one read."""
    per_draft = drafts_under_discipline(tiny_model("llama", seed=1), draft_model_proposer("dense", budget=40))
    assert [reads for reads, _ in per_draft] == [1] * len(per_draft)
