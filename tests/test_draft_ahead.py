"""Drafting ahead on the fixed-shape path: the cost-aware builder over an EAGLE-3 head queues the next step's draft
before the step's result is read (the head fed the accepted rows on the device, its levels placed from a device
count), so that one read a step brings the result and the next draft. Its drafts are the drafts the eager path
makes after the read, its tokens the eager path's, and every step -- the prefill's included -- reads once."""

from __future__ import annotations

import numpy as np
import pytest

from graft_cli.drafting import CostAwareProposer, LatencyModel, Objective, match_target
from graft_cli.heads import load_head
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.eagle3 import Eagle3Drafter
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.test_device import Discipline
from tests.test_eagle3 import target_model, write_head
from tests.tiny import VOCAB

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=8, top_p=0.95)}


@pytest.fixture(scope="module")
def model_and_head(tmp_path_factory):
    model = target_model(seed=2)
    return model, str(write_head(tmp_path_factory.mktemp("ahead") / "head", model, seed=1))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokens = np.random.default_rng(10).integers(0, VOCAB, 24).tolist()
    return tokens + tokens[:12]  # something for prompt lookup to find


def proposer(model_and_head, retrievers=(), always: bool = False) -> CostAwareProposer:
    """The cost-aware builder, planned (as on a GPU), over a random head. ``always``: it drafts every step, all
    levels deep, on the prior costs (nothing measured): its decisions then depend on no clock and no retrieval."""
    model, head = model_and_head
    objective = Objective(LatencyModel.default("cpu"), max_levels=5, planned=True)
    if always:
        objective.should_draft = lambda bucket: True
        objective.measured = lambda *args: None
        objective.extend = lambda *args: True
    return CostAwareProposer(16, list(retrievers), Eagle3Drafter(load_head(head, model), model, depth=5, top_k=3),
                             objective.latency, objective)


def recorded(proposer) -> list[list[tuple[int, int, float]]]:
    trees, propose = [], proposer.propose

    def recording(context, stats):
        tree = propose(context, stats)
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
    ahead = match_target(proposer(model_and_head, always=True), target)
    trees = recorded(ahead)
    assert generated(target, ahead, prompt, sampling) == truth
    assert len(trees) == len(eager_trees) and sum(map(len, trees)) > 6 * len(trees)  # levels deep
    for tree, eager_tree in zip(trees, eager_trees):
        assert [node[:2] for node in tree] == [node[:2] for node in eager_tree]
        np.testing.assert_allclose([node[2] for node in tree], [node[2] for node in eager_tree], rtol=1e-4)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_one_read_a_step_with_a_head_and_retrievers(model_and_head, prompt, sampling):
    """Token Recycling's top-k, the result and the next draft: one read."""
    model = model_and_head[0]
    truth = generated(Target(model), proposer(model_and_head, [PromptLookup(), AdjacencyRetriever(VOCAB)]), prompt,
                      sampling)
    target = FixedShapeTarget(model)
    ahead = match_target(proposer(model_and_head, [PromptLookup(), AdjacencyRetriever(VOCAB)]), target)
    mode, reads = Discipline(scope=("graft_cli/", "plugins/"), strict=False), [0]
    steps = decode(target, ahead, prompt, sampling, 60, set(), 11)
    with mode:
        got = list(next(steps))
        reads.append(mode.reads)
        for new in steps:
            got += new
            reads.append(mode.reads)
    assert got == truth
    assert list(np.diff(reads)) == [1] * (len(reads) - 1)  # the prefill's, then each step's
    assert sum(record["levels"] > 0 for record in ahead.trace) >= 5  # it drafted, ahead


def test_a_step_read_without_its_draft_falls_back_to_drafting_after_it(model_and_head, prompt):
    """A step that cannot queue ahead (here every third, as a step the buckets cannot hold) hands its rows over
    after the read; the head reads them at its next draft, and the tokens stay the eager path's."""
    model = model_and_head[0]
    truth = generated(Target(model), proposer(model_and_head, always=True), prompt, Sampling())
    target = FixedShapeTarget(model)
    ahead = match_target(proposer(model_and_head, always=True), target)
    step, calls = target.step, [0]

    def sometimes(root, tree, hidden, position, queue=None, **rule):
        calls[0] += 1
        return step(root, tree, hidden, position, None if calls[0] % 3 == 0 else queue, **rule)
    target.step = sometimes
    assert generated(target, ahead, prompt, Sampling()) == truth
    assert sum(record["levels"] > 0 for record in ahead.trace) == len(ahead.trace)  # every step drafted
