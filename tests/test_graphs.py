"""Capture safety without a GPU: every region the fixed-shape path captures runs under
``torch.compile(backend=..., fullgraph=True, dynamic=False)`` -- which fails on ``.item()``, ``.tolist()``, boolean
indexing and data-dependent control flow, exactly what would break a CUDA graph or re-record it -- and a recompile
while replaying (a Python int that changed, a shape that moved) is an error. And a capture that fails falls back
to the eager path, with one line on stderr and the same tokens."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch._dynamo

from graft_cli.core import PruneSchedule, Stats
from graft_cli.drafting import CostAwareProposer, LatencyModel, Objective
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.heads import load_head
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.graphs import Graphs
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from graft_cli.bench.synthetic import CountedGraphs, OracleTreeProposer, copy_outputs
from plugins.eagle3 import Eagle3Drafter
from plugins.prompt_lookup import PromptLookup
from tests.test_device import draft_model_proposer, following
from tests.test_eagle3 import target_model, write_head
from tests.tiny import VOCAB, tiny_model

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=8, top_p=0.95)}


class CompiledCapture:
    """A capture a CPU can make: the region compiled whole by dynamo at static shapes. Like a CUDA graph, the
    capture's outputs are the region's outputs for good: each replay runs the compiled region and copies what it
    returns into them (the capture's own run stands in for the first replay). A compile during a replay -- a
    guard that failed, i.e. a recompile -- raises."""

    def __init__(self) -> None:
        self.compiles, self.replays, self.replaying = 0, 0, False

    def backend(self, graph: torch.fx.GraphModule, example_inputs) -> object:
        if self.replaying:
            raise AssertionError("a captured region recompiled while replaying")
        self.compiles += 1
        return graph.forward

    def __call__(self, region):
        compiled = torch.compile(region, backend=self.backend, fullgraph=True, dynamic=False)
        out = compiled()
        pending = [True]  # the capture ran the region: its first replay has nothing left to do

        def replay() -> None:
            if pending.pop() if pending else False:
                return
            self.replaying, self.replays = True, self.replays + 1
            try:
                copy_outputs(out, compiled())
            finally:
                self.replaying = False
        return replay, out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=256):
        yield
    torch._dynamo.reset()


def decoded(target: Target, proposer, prompt: list[int], sampling: Sampling, n: int,
            stats: Stats | None = None) -> list[int]:
    return [t for step in decode(target, proposer, prompt, sampling, n, set(), 11, stats) for t in step]


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_verification_and_acceptance_compile_whole_and_never_recompile(sampling):
    """Over changing trees (every bucket but the largest) and a growing cache, each region compiles once per key;
    the replays give plain decoding's tokens."""
    model = tiny_model("qwen2", seed=8)
    prompt = np.random.default_rng(8).integers(0, VOCAB, 20).tolist()
    truth = decoded(Target(model), GraftProposer(0), prompt, sampling, 90)
    capture = CompiledCapture()
    target = FixedShapeTarget(model, capture=capture)
    target.graphs.warmup = 1
    stats, oracle = Stats(), OracleTreeProposer(truth, len(prompt), 5)
    oracle.successors = 8  # every row's top-k taken in the acceptance region too (Token Recycling's)
    got = decoded(target, oracle, prompt, sampling, 90, stats)
    assert got == truth and stats.steps >= 20
    keys = target.graphs.captured
    assert capture.compiles == len(keys) and len({key[:2] for key in keys}) >= 4  # verify + accept, 2+ buckets
    assert capture.replays >= 20


def test_a_capture_that_fails_runs_eagerly_with_one_line(capsys):
    model = tiny_model(seed=9)
    prompt = np.random.default_rng(9).integers(0, VOCAB, 16).tolist()
    truth = decoded(Target(model), GraftProposer(0), prompt, Sampling(), 60)

    def failing(region):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    target = FixedShapeTarget(model, capture=failing)
    assert decoded(target, OracleTreeProposer(truth, len(prompt), 6), prompt, Sampling(), 60) == truth
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == len(target.graphs.failed) > 0 and not target.graphs.captured
    assert all(line.startswith("graft: ") and "runs eagerly" in line and "more detail" not in line for line in lines)


def test_graphs_warm_up_then_capture_once_and_forget_when_memory_moves():
    calls, captures = Counter(), []

    def capture(region):
        captures.append(region)
        return (lambda: calls.update(["replay"])), region()

    graphs = Graphs(capture, warmup=2)
    for _ in range(5):
        graphs.run("key", lambda: calls.update(["eager"]))
    assert calls == {"eager": 3, "replay": 3} and len(captures) == 1  # 2 warm-ups, the capture's run, 3 replays
    graphs.forget()
    graphs.run("key", lambda: calls.update(["eager"]))
    assert calls["eager"] == 4 and not graphs.captured
    assert graphs.run(None, lambda: "eager") == "eager"


def test_graph_keys_stay_bounded_whatever_the_sampling_settings():
    """A server meets many sampling settings, an acceptance graph each: past the limit every graph is dropped at a
    step's start and recorded again as its shapes come back (the books a GPU keeps, kept on a CPU)."""
    model = tiny_model(seed=9)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 16).tolist()
    target = FixedShapeTarget(model)
    target.graphs = CountedGraphs(limit=6)
    most = 0
    for i in range(10):
        sampling = Sampling(temperature=0.5 + 0.05 * i, top_k=4 * (i % 3), top_p=1 - 0.02 * i)
        truth = decoded(Target(model), GraftProposer(0), prompt, sampling, 20)
        assert decoded(target, OracleTreeProposer(truth, len(prompt), 4), prompt, sampling, 20) == truth
        most = max(most, len(target.graphs.calls))
    assert most <= 6 + 2 and target.graphs.captured  # a step's two keys past the limit, until the next step


def eagle3_proposer(root, target, cost_aware: bool) -> GraftProposer:
    """A random head drafting for ``target``: dense levels, or the cost-aware builder (planned, as on a GPU),
    which on the fixed-shape path queues each draft before the step's read (tests/test_draft_ahead.py)."""
    head = load_head(str(write_head(root, target, seed=1)), target)
    if not cost_aware:
        drafter = Eagle3Drafter(head, target, depth=4, top_k=3, prune=PruneSchedule.parse("0:0.3,1:0.2", floor=0.02))
        return GraftProposer(12, [PromptLookup()], drafter=drafter)
    objective = Objective(LatencyModel.default("cpu"), max_levels=5, planned=True)
    return CostAwareProposer(16, [PromptLookup()], Eagle3Drafter(head, target, depth=5, top_k=3),
                             objective.latency, objective)


def draft_model_ahead() -> GraftProposer:
    """A tiny draft model under the cost-aware builder, planned, drafting before each step's read."""
    proposer = draft_model_proposer("graft", budget=12, depth=4, top_k=3,
                                    objective=Objective(LatencyModel.default("cpu"), max_levels=4, planned=True))
    proposer.drafter.before_read = True
    return proposer


@pytest.mark.parametrize("drafter", ["head", "head cost-aware", "draft model", "draft model cost-aware"])
def test_draft_levels_compile_whole_and_never_recompile(tmp_path, drafter):
    """The drafter's levels (an EAGLE-3 head's or a draft model's) and the target's regions, over 40 tokens of
    changing trees: each compiles once per key, and decoding gives the eager path's tokens."""
    if drafter == "draft model":
        model, build = tiny_model(seed=1), lambda: draft_model_proposer("pruned", budget=12, depth=4, top_k=3)
    elif drafter == "draft model cost-aware":
        model, build = tiny_model(seed=1), draft_model_ahead
    else:
        model = target_model(seed=2)
        build = lambda: eagle3_proposer(tmp_path / "head", model, cost_aware=drafter.endswith("cost-aware"))  # noqa: E731
    prompt = np.random.default_rng(10).integers(0, VOCAB, 24).tolist()
    prompt += prompt[:12]  # something for prompt lookup to find
    eager = build()
    eager_trees = recorded(eager)
    truth = decoded(Target(model), eager, prompt, Sampling(), 40)
    capture = CompiledCapture()
    target = FixedShapeTarget(model, capture=capture)
    proposer = following(build(), target)
    trees = recorded(proposer)
    drafter_graphs = proposer.drafter.fixed.graphs
    target.graphs.warmup = drafter_graphs.warmup = 1
    assert decoded(target, proposer, prompt, Sampling(), 40) == truth
    levels = [key for key in drafter_graphs.captured if key[0].endswith("level")]
    assert levels and capture.compiles == len(target.graphs.captured) + len(drafter_graphs.captured)
    assert capture.replays >= 10
    # a head reads its layers of the accepted rows as the verification graph's one small output, gathered in
    # the acceptance graph: the same drafts as from the eager path's every-layer states
    layers = proposer.drafter.needs.layers
    assert {key[3] for key in target.graphs.captured if key[0] == "verify"} == {layers}
    if drafter.endswith("cost-aware"):  # queued ahead: the drafter's catch-up is a region too; whether to draft is
        # decided before the step's retrieval, so the trees differ (tests/test_draft_ahead.py compares the drafts)
        assert any(key[0].endswith("catch-up") for key in drafter_graphs.captured)
    else:
        assert trees == eager_trees


def recorded(proposer) -> list[list[tuple[int, int]]]:
    """Every tree ``proposer`` proposes from now on, as (token, parent) pairs: filled as it proposes."""
    trees, propose = [], proposer.propose

    def recording(context):
        tree = propose(context)
        trees.append([(node.token, node.parent) for node in tree.nodes])
        return tree
    proposer.propose = recording
    return trees
