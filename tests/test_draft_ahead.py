"""Drafting ahead on the fixed-shape path: the cost-aware builder over an EAGLE-3 head or a draft model queues the
next step's draft before the step's result is read (the drafter fed the accepted tokens on the device, its levels
placed from a device count), so that one read a step brings the result and the next draft. Its drafts are the
drafts the eager path makes after the read, its tokens the eager path's, and every step -- the prefill's included
-- reads once."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from graft_cli.core import Step, Tree
from graft_cli.drafting import AutoBudget, CostAwareProposer, LatencyModel, Objective
from graft_cli.heads import load_head
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget, drafter_shapes
from graft_cli.runtime.graphs import CudaCapture
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.draft_model import DraftModelDrafter
from plugins.eagle3 import Eagle3Drafter
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.test_device import decode_reading
from tests.test_eagle3 import target_model, write_head
from tests.tiny import VOCAB, tiny_model

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=8, top_p=0.95)}


@pytest.fixture(scope="module")
def model_and_head(tmp_path_factory):
    model = target_model(seed=2)
    return model, str(write_head(tmp_path_factory.mktemp("ahead") / "head", model, seed=1))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokens = np.random.default_rng(10).integers(0, VOCAB, 24).tolist()
    return tokens + tokens[:12]  # something for prompt lookup to find


def objective(always: bool) -> Objective:
    """Planned, as on a GPU. ``always``: it drafts every step, all levels deep, on the prior costs (nothing
    measured): its decisions then depend on no clock and no retrieval."""
    made = Objective(LatencyModel.default("cpu"), max_levels=5, planned=True)
    if always:
        made.should_draft = lambda bucket: True
        made.measured = lambda *args: None
        made.extend = lambda *args: True
    return made


def proposer(model_and_head, retrievers=(), always: bool = False, drafter: str = "head",
             target: Target | None = None) -> CostAwareProposer:
    """The cost-aware builder over a random head, or over a tiny draft model (its levels on ``target``'s fixed
    shapes when it has them)."""
    model, head = model_and_head
    if drafter == "head":
        made = Eagle3Drafter(load_head(head, model), model, depth=5, top_k=3)
    else:
        made = DraftModelDrafter(tiny_model("llama", seed=1), VOCAB, depth=5, top_k=3, before_read=True)
    shapes = None if target is None else drafter_shapes(target)
    if shapes is not None:
        made.fix_levels(shapes.capture)
    rule = objective(always)
    return CostAwareProposer(16, list(retrievers), made, rule.latency, rule)


def recorded(proposer) -> list[list[tuple[int, int, float]]]:
    trees, propose = [], proposer.propose

    def recording(context):
        tree = propose(context)
        trees.append([(node.token, node.parent, node.score) for node in tree.nodes])
        return tree
    proposer.propose = recording
    return trees


def generated(target, proposer, prompt, sampling, n: int = 60) -> list[int]:
    return [t for step in decode(target, proposer, prompt, sampling, n, set(), 11) for t in step]


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_the_drafts_queued_ahead_are_the_drafts_after_the_read(model_and_head, prompt, sampling):
    model = model_and_head[0]
    eager = proposer(model_and_head, always=True)
    eager_trees = recorded(eager)
    truth = generated(Target(model), eager, prompt, sampling)
    target = FixedShapeTarget(model)
    ahead = proposer(model_and_head, always=True, target=target)
    trees = recorded(ahead)
    assert generated(target, ahead, prompt, sampling) == truth
    assert len(trees) == len(eager_trees) and sum(map(len, trees)) > 6 * len(trees)  # levels deep
    for tree, eager_tree in zip(trees, eager_trees):
        assert [node[:2] for node in tree] == [node[:2] for node in eager_tree]
        np.testing.assert_allclose([node[2] for node in tree], [node[2] for node in eager_tree], rtol=1e-4)


def test_a_draft_models_drafts_queued_ahead_are_its_drafts_after_the_read(model_and_head, prompt):
    """The draft model joins the request at a step's queue (not at the prefill), so its steps are not the eager
    path's: each draft is compared with a fresh drafter's eager draft of the same context instead (every draft
    keeping the 16 best nodes of all its levels)."""
    model = model_and_head[0]
    target = FixedShapeTarget(model)
    ahead = proposer(model_and_head, always=True, drafter="model", target=target)
    ahead.objective.replan = lambda levels, rows: 16
    drafts, draft = [], ahead.drafter.draft

    def recording(context, budget, chain=(), rule=None):
        tree = draft(context, budget, chain, rule)
        drafts.append((list(context), [(node.token, node.parent, node.score) for node in tree.nodes]))
        return tree
    ahead.drafter.draft = recording
    assert generated(target, ahead, prompt, Sampling()) == generated(Target(model), proposer(model_and_head),
                                                                     prompt, Sampling())
    assert len(drafts) > 10
    for context, tree in drafts:
        fresh = DraftModelDrafter(tiny_model("llama", seed=1), VOCAB, depth=5, top_k=3)
        fresh.start(prompt, Step(list(prompt), [], Tree(), []), len(context) + 64)
        rule = objective(always=True)
        rule.replan = lambda levels, rows: 16
        eager = [(node.token, node.parent, node.score) for node in fresh.draft(context, 16, (), rule).nodes]
        assert [node[:2] for node in tree] == [node[:2] for node in eager]
        np.testing.assert_allclose([node[2] for node in tree], [node[2] for node in eager], rtol=1e-4)


@pytest.mark.parametrize("drafter", ["head", "model"])
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_one_read_a_step_with_a_drafter_and_retrievers(model_and_head, prompt, sampling, drafter):
    """Token Recycling's top-k, the result and the next draft: one read, a draft model's joining included."""
    model = model_and_head[0]
    retrievers = lambda: [PromptLookup(), AdjacencyRetriever(VOCAB)]  # noqa: E731
    truth = generated(Target(model), proposer(model_and_head, retrievers(), drafter=drafter), prompt, sampling)
    target = FixedShapeTarget(model)
    ahead = proposer(model_and_head, retrievers(), drafter=drafter, target=target)
    got, reads = decode_reading(target, ahead, prompt, sampling, 60, seed=11)
    assert got == truth
    assert reads == [1] * len(reads)  # the prefill's, then each step's
    assert sum(record["levels"] > 0 for record in ahead.trace) >= 5  # it drafted, ahead


def test_a_step_read_without_its_draft_falls_back_to_drafting_after_it(model_and_head, prompt):
    """A step that cannot queue ahead (here every third, as a step the buckets cannot hold) hands its rows over
    after the read; the next step does not draft (a draft after the read would read twice), and the next queue
    feeds the head those rows first. The tokens stay the eager path's."""
    model = model_and_head[0]
    truth = generated(Target(model), proposer(model_and_head, always=True), prompt, Sampling())
    target = FixedShapeTarget(model)
    ahead = proposer(model_and_head, always=True, target=target)
    step, calls = target.step, [0]

    def sometimes(context, tree, rule):
        calls[0] += 1
        return step(context, tree, rule if calls[0] % 3 else replace(rule, needs=replace(rule.needs, queue=None)))
    target.step = sometimes
    got = generated(target, ahead, prompt, Sampling())
    assert got == truth
    drafter = ahead.drafter  # every pair of the context in the head's cache (the newest token's comes next)
    assert drafter.committed + len(drafter.pending_tokens) == len(prompt) + len(got) - 1
    drafted = [record["levels"] > 0 for record in ahead.trace]
    assert drafted.count(False) >= 5 and drafted.count(True) >= 2 * drafted.count(False)


def test_a_draft_model_drafts_after_the_read_unless_asked():
    """By default a draft model keeps checking the retrieved chain exactly, which needs the step's read."""
    default, asked = (DraftModelDrafter(tiny_model("llama", seed=1), VOCAB, before_read=before)
                      for before in (False, True))
    for drafter in (default, asked):
        drafter.fix_levels(None)
    assert not default.queues(objective(False)) and asked.queues(objective(False))


def test_the_drafters_graphs_record_into_a_pool_of_their_own(model_and_head):
    """A draft queued ahead replays the drafter's graphs before the step's result is read: recorded into the
    target's pool, they could reuse the memory that result sits in."""
    target = FixedShapeTarget(model_and_head[0], capture=CudaCapture())
    drafter = proposer(model_and_head, target=target).drafter
    assert isinstance(drafter.fixed.graphs.capture, CudaCapture)
    assert drafter.fixed.graphs.capture is not target.graphs.capture


def test_the_auto_budget_drafts_ahead_as_a_fixed_budget_does(model_and_head, prompt):
    """``--budget auto`` wraps the proposer: what the inner one needs of each step, its draft queued before the
    read included, is what the loop sees, so it too reads the device once a step."""
    model = model_and_head[0]
    truth = generated(Target(model), proposer(model_and_head, always=True), prompt, Sampling())
    target = FixedShapeTarget(model)
    inner = proposer(model_and_head, always=True, target=target)
    auto = AutoBudget(inner, inner.latency)
    assert auto.needs.queue is not None and auto.needs == inner.needs
    got, reads = decode_reading(target, auto, prompt, Sampling(), 60, seed=11)
    assert got == truth and reads == [1] * len(reads)
    assert sum(record["levels"] > 0 for record in inner.trace) >= 5  # it drafted, ahead
