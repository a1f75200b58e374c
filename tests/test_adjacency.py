"""The Token Recycling adjacency table: updates from every verified node, template lookups with real scores,
atomic save/load, the entry point, and the method through the loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.sampling import Sampling
from graft_cli.core import RetrieverEnv, ROOT, Stats, Step, Tree
from graft_cli.runtime.target import Target
from graft_cli.core.discovery import load_factory
from plugins.adjacency import DEFAULT_TEMPLATE, AdjacencyRetriever
from tests.test_tree import check_invariants
from tests.tiny import VOCAB, tiny_model


def verified_step(rng, vocab=30):
    tree = Tree()
    for _ in range(int(rng.integers(1, 12))):
        parent = ROOT if not len(tree) or rng.random() < 0.4 else int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)), "x", 0.5)
    context = rng.integers(0, vocab, 8).tolist()
    accepted = [int(rng.integers(vocab))]
    logits = torch.randn(len(tree) + 1, vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    return Step(context + accepted, accepted, tree, [0], logits)


def test_every_verified_node_updates_its_tokens_row():
    rng = np.random.default_rng(0)
    table = AdjacencyRetriever(30, k=4)
    step = verified_step(rng)
    table.observe(step)
    fed = [step.context[-2], *step.tree.tokens()]  # row 0: the root, row i + 1: node i
    top = torch.topk(torch.softmax(step.logits, dim=-1), 4, dim=-1)
    for token in set(fed):
        rows = [r for r, t in enumerate(fed) if t == token]  # a token fed twice: one of its rows wins
        assert any(table.tokens[token].tolist() == top.indices[r].tolist()
                   and torch.allclose(table.probs[token], top.values[r]) for r in rows)
    untouched = set(range(30)) - set(fed)
    assert all(float(table.probs[t].sum()) == 0 for t in untouched)


def test_the_prefill_updates_the_last_prompt_token():
    table = AdjacencyRetriever(20, k=3)
    logits = torch.full((1, 20), -10.0)
    logits[0, 7] = 5.0
    table.observe(Step([1, 2, 3, 7], [7], Tree(), [0, 1, 2], logits))
    assert table.tokens[3, 0] == 7 and table.probs[3, 0] > 0.99


def table_with_chains(vocab=50, k=3):
    table = AdjacencyRetriever(vocab, k=k, template=(2, 3, 2, 1))
    gen = torch.Generator().manual_seed(1)
    table.tokens[:] = torch.randint(0, vocab, (vocab, k), generator=gen, dtype=torch.int32)
    probs = torch.rand((vocab, k), generator=gen)
    table.probs[:] = (probs / probs.sum(dim=1, keepdim=True)).sort(dim=1, descending=True).values
    return table


def test_lookup_follows_the_template_with_product_scores():
    table = table_with_chains()
    tree = table.retrieve([4, 9], 100)
    check_invariants(tree)
    widths = np.bincount([n.depth for n in tree.nodes])[1:].tolist()
    assert widths == [2, 3, 2, 1]
    for i, node in enumerate(tree.nodes):
        parent_token = 9 if node.parent == ROOT else tree.nodes[node.parent].token
        succ = table.tokens[parent_token].tolist()
        assert node.token in succ
        q = float(table.probs[parent_token][succ.index(node.token)])
        parent_score = 1.0 if node.parent == ROOT else tree.nodes[node.parent].score
        assert node.score == pytest.approx(parent_score * q)
    # the greedy chain runs deepest
    token, depth_of_greedy = 9, 0
    node = ROOT
    while (child := tree.child(node, int(table.tokens[token][0]))) is not None:
        node, token, depth_of_greedy = child, tree.nodes[child].token, depth_of_greedy + 1
    assert depth_of_greedy == 4


@pytest.mark.parametrize("budget", [0, 1, 5, 11])
def test_lookup_is_trimmed_to_the_budget(budget):
    tree = table_with_chains().retrieve([3], budget)
    assert len(tree) == min(budget, 8)
    check_invariants(tree)


def test_an_empty_table_proposes_nothing():
    assert len(AdjacencyRetriever(10).retrieve([1, 2], 20)) == 0


def test_save_and_load_round_trip_atomically(tmp_path):
    path = tmp_path / "sub" / "adj.safetensors"
    table = AdjacencyRetriever(40, k=4, path=str(path))
    table.observe(verified_step(np.random.default_rng(2), vocab=40))
    table.close()
    assert path.exists() and [p.name for p in path.parent.iterdir()] == ["adj.safetensors"]  # no temp file left
    again = AdjacencyRetriever(40, k=4, path=str(path))
    assert torch.equal(again.tokens, table.tokens) and torch.equal(again.probs, table.probs)
    mtime = path.stat().st_mtime_ns
    table.close()  # a second close does nothing
    assert path.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="vocabulary of 40"):
        AdjacencyRetriever(41, path=str(path))
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable"):
        AdjacencyRetriever(40, path=str(path))


def test_entry_point_and_options(tmp_path):
    factory = load_factory("recycling")
    path = tmp_path / "a.safetensors"
    table = factory(RetrieverEnv(vocab_size=33, options={"adjacency_file": str(path), "recycling.k": "5",
                                                         "recycling.template": "4,3"}, name="recycling"))
    assert table.name == "recycling" and table.k == 5 and table.template == (4, 3) and table.path == path
    assert factory(RetrieverEnv(vocab_size=33)).template == DEFAULT_TEMPLATE


def test_proposer_close_saves_the_table(tmp_path):
    path = tmp_path / "adj.safetensors"
    table = AdjacencyRetriever(VOCAB, path=str(path))
    proposer = GraftProposer(10, [table])
    model = tiny_model(seed=9)
    list(decode(Target(model), proposer, [5, 6, 7, 5, 6, 7], Sampling(), 30, set(), 0))
    assert not path.exists()
    proposer.close()
    assert path.exists()


def test_recycling_learns_a_repetitive_target():
    """A target that loops: after warm-up the table predicts the loop and most tokens come from it."""
    model = tiny_model(seed=10)
    proposer = GraftProposer(20, [AdjacencyRetriever(VOCAB)])
    proposer.latency.points = {1: 1.0, 64: 1.0}
    prompt = [1, 2, 3]
    truth = [t for s in decode(Target(model), GraftProposer(0), prompt, Sampling(), 120, set(), 0) for t in s]
    stats = Stats()
    got = [t for s in decode(Target(model), proposer, prompt, Sampling(), 120, set(), 0, stats) for t in s]
    assert got == truth
    if len(set(truth[60:])) < 20:  # the tiny model fell into a cycle: recycling must ride it
        assert stats.tau > 1.5
