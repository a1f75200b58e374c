"""Pruning and grafting without models: EAGLE-2 expansion against a brute-force reference, checkpoints, budget,
prefix closure, duplicates, positions and masks; and the sampling test through the whole graft path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import graft_cli.runtime.engine as engine
from graft_cli.drafting.tree_drafter import TreeDrafter
from plugins.draft_model import DraftModelDrafter
from graft_cli.core import GraftError, Needs, PruneSchedule, ROOT, Stats, Tree
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.test_sampling import PROMPT, SETTINGS, V, chi_square_rejects, exact_joint
from tests.test_tree import check_invariants, random_tree
from tests.tiny import tiny_model

SV = 12  # synthetic vocabulary


def synthetic_logp(path: tuple[int, ...], peak: float = 3.0) -> torch.Tensor:
    """A fixed pseudo-random next-token distribution for every path."""
    rng = np.random.default_rng(abs(hash(path)) % 2**32)
    logits = torch.tensor(rng.normal(size=SV) * peak, dtype=torch.float32)
    return torch.log_softmax(logits, dim=-1)


class SyntheticDrafter(TreeDrafter):
    """A drafter whose distributions are a function of the path. It rebuilds each fed node's path from the
    mask alone (ancestors' rows in feeding order), so a wrong mask gives wrong distributions."""

    def __init__(self, *args, peak: float = 3.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak = peak
        self.rows: list[int] = []  # token of each tree row
        self.forwards: list[int] = []  # rows fed per forward
        self.context: tuple[int, ...] = ()

    def _root(self, context):
        self.context = tuple(context)
        self.forwards.append(1)
        return synthetic_logp(self.context, self.peak), None

    def _grow(self, tokens, states, depth, mask):
        assert mask.shape == (len(tokens), len(self.rows) + len(tokens))
        start = len(self.rows)
        self.rows.extend(tokens.tolist())
        out = []
        for i in range(len(tokens)):
            allowed = mask[i].nonzero().flatten().tolist()
            assert allowed[-1] == start + i  # itself, last
            path = tuple(self.rows[r] for r in allowed)
            assert len(path) == (int(depth[i]) if torch.is_tensor(depth) else depth)  # its ancestors and itself
            out.append(synthetic_logp(self.context + path, self.peak))
        self.forwards.append(len(tokens))
        return torch.stack(out), None

    def _drop_tree(self, keep_rows):
        self.rows = []
        self.tree_rows = 0


def reference_pool(context, depth, k, prune=None, budget=None, peak=3.0):
    """EAGLE-2 written the obvious way: (path -> cumulative log-prob) of every candidate, and the stop level."""
    pool = {}
    logp = synthetic_logp(tuple(context), peak)
    frontier = []
    for value, token in zip(*torch.topk(logp, k)):
        pool[(int(token),)] = float(value)
        frontier.append((int(token),))
    level = 0
    while True:
        if prune is not None:
            point = prune.stops(level, max(pool[p] for p in frontier))
            if point is not None:
                return pool, point
        if level + 1 >= depth:
            return pool, None
        cands = []
        for path in frontier:
            lp = synthetic_logp(tuple(context) + path, peak)
            for value, token in zip(*torch.topk(lp, k)):
                child = path + (int(token),)
                pool[child] = pool[path] + float(value)
                cands.append(child)
        frontier = sorted(cands, key=lambda p: -pool[p])[:k]
        level += 1


def paths_of(tree: Tree) -> dict[tuple[int, ...], float]:
    out = {}
    for i, node in enumerate(tree.nodes):
        path, j = [], i
        while j != ROOT:
            path.append(tree.nodes[j].token)
            j = tree.nodes[j].parent
        out[tuple(reversed(path))] = node.score
    return out


def check_tree(tree: Tree, budget: int) -> None:
    """Budget, prefix closure, no duplicate siblings, scores non-increasing, and verification's positions/mask."""
    assert len(tree) <= budget
    check_invariants(tree)
    mask, depths = tree.ancestor_mask(), tree.depths()
    for i, node in enumerate(tree.nodes, start=1):
        ancestors, j = {0, i}, node.parent
        while j != ROOT:
            ancestors.add(j + 1)
            j = tree.nodes[j].parent
        assert set(np.flatnonzero(mask[i]).tolist()) == ancestors
        assert depths[i] == len(ancestors) - 1


@pytest.mark.parametrize("seed", range(6))
def test_dense_expansion_matches_reference_eagle2(seed):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, SV, 5).tolist()
    depth, k, budget = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 30))
    drafter = SyntheticDrafter(depth=depth, top_k=k)
    stats = Stats()
    drafter.recorder.begin(stats)
    tree = drafter.draft(context, budget)
    check_tree(tree, budget)
    pool, _ = reference_pool(context, depth, k)
    best = sorted(pool.items(), key=lambda kv: (-kv[1], len(kv[0])))[:budget]
    got = paths_of(tree)
    assert len(got) == len(best)
    for path, logp in best:  # the same best nodes by cumulative probability (up to score ties)
        if path not in got:
            assert any(abs(math.exp(logp) - s) < 1e-6 for s in got.values())
        else:
            assert got[path] == pytest.approx(math.exp(logp), rel=1e-5)
    assert stats.draft_forwards == len(drafter.forwards) <= depth
    assert all(n <= k for n in drafter.forwards[1:])  # one batched forward per level, top_k nodes at most


def test_settled_pool_stops_drafting_without_changing_the_tree():
    context = [1, 2, 3]
    full = SyntheticDrafter(depth=8, top_k=3)
    tree = full.draft(context, 4)
    pool, _ = reference_pool(context, 8, 3)
    best = sorted(pool.items(), key=lambda kv: (-kv[1], len(kv[0])))[:4]
    assert set(paths_of(tree)) == {p for p, _ in best}
    assert len(full.forwards) < 8  # the four best were known before depth 8


@pytest.mark.parametrize("peak", [0.3, 1.0, 3.0, 8.0])
def test_pruning_stops_at_the_first_unconfident_checkpoint(peak):
    prune = PruneSchedule.parse("0:0.35,1:0.25,5:0.15")  # no floor: the paper's checkpoints alone
    context = [4, 5]
    budget = 30
    drafter = SyntheticDrafter(depth=7, top_k=3, prune=prune, peak=peak)
    stats = Stats()
    drafter.recorder.begin(stats)
    tree = drafter.draft(context, budget)
    _, point = reference_pool(context, 7, 3, prune, peak=peak)
    assert drafter.stopped_at == point
    check_tree(tree, budget)
    if point is not None:
        assert len(tree) <= prune.keep(point, budget)
        assert drafter.levels == point.level + 1 == stats.draft_forwards
    if peak == 0.3:  # flat distributions: nobody is confident at the root
        assert point is not None and point.level == 0 and stats.draft_forwards == 1


def test_prune_schedule_parsing():
    s = PruneSchedule.parse("0:0.35,1:0.25,5:0.15")
    assert [(p.level, p.threshold) for p in s.checkpoints] == [(0, 0.35), (1, 0.25), (5, 0.15)]
    assert [s.keep(p, 60) for p in s.checkpoints] == [8, 24, 40]  # the paper's 60-node example
    assert s.checkpoints == PruneSchedule.default().checkpoints and s.floor == 0
    assert PruneSchedule.default("cpu").floor == 0.1 and PruneSchedule.default("cuda").floor == 0.02
    assert PruneSchedule.parse("1:0.2,floor:0.3").floor == 0.3 and PruneSchedule.parse("1:0.2", 0.05).floor == 0.05
    assert PruneSchedule.parse("none", 0.1).floor == 0.1 and not PruneSchedule.parse("none").checkpoints
    assert PruneSchedule.parse("2:0.5:0.5").keep(PruneSchedule.parse("2:0.5:0.5").checkpoints[0], 16) == 8
    assert PruneSchedule.parse("none").checkpoints == ()
    assert s.stops(0, math.log(0.3)) is not None and s.stops(0, math.log(0.4)) is None
    assert s.stops(3, math.log(0.01)) is None  # not a checkpoint
    assert s.chain_threshold(0) == 0.35 and s.chain_threshold(4) == 0.25 and s.chain_threshold(9) == 0.15
    for bad in ["0", "x:0.3", "0:1.5", "-1:0.2", "0:0.3,0:0.2", "1:0.2:0", "floor:1.2", "floor:x", "floor"]:
        with pytest.raises(GraftError):
            PruneSchedule.parse(bad)


@pytest.mark.parametrize("peak", [1.0, 2.0, 4.0])
def test_the_floor_never_expands_an_unlikely_node(peak):
    prune = PruneSchedule.parse("none", floor=0.2)
    for seed in range(5):
        drafter = SyntheticDrafter(depth=6, top_k=3, prune=prune, peak=peak)
        stats = Stats()
        drafter.recorder.begin(stats)
        tree = drafter.draft([seed, 7], 40)
        check_tree(tree, 40)
        assert all(drafter.pool.nodes[n].score >= 0.2 for n in drafter.fed)
        dense = SyntheticDrafter(depth=6, top_k=3, peak=peak)
        dense.draft([seed, 7], 40)
        assert sum(drafter.forwards[1:]) <= sum(dense.forwards[1:])  # fewer draft rows
        # every node the dense drafter fed with probability >= floor was fed here too (same paths)
        fed = {p for p, s in paths_of_nodes(drafter.pool, drafter.fed).items()}
        for path, score in paths_of_nodes(dense.pool, dense.fed).items():
            assert score < 0.2 or path in fed or len(path) >= drafter.levels


def paths_of_nodes(tree: Tree, nodes) -> dict:
    every = paths_of(tree)
    keys = list(every)
    return {keys[i]: every[keys[i]] for i in nodes}


def test_chain_keeps_the_confident_prefix():
    prune = PruneSchedule.parse("0:0.2,2:0.1")
    for seed in range(10):
        context = [seed, seed + 1]
        drafter = SyntheticDrafter(depth=8, top_k=5, chain=True, prune=prune)
        tree = drafter.draft(context, 16)
        assert [len(p) for p in tree.paths()] in ([], [len(tree)])  # one path
        for node in tree.nodes:
            assert node.score >= prune.chain_threshold(node.depth - 1)
        # the greedy chain of the synthetic model
        path = []
        for _ in range(len(tree)):
            path.append(int(synthetic_logp(tuple(context + path)).argmax()))
        assert tree.tokens() == path


class RandomRetriever:
    stateless = True

    def __init__(self, name, seed):
        self.name, self.rng = name, np.random.default_rng(seed)

    def start(self, prompt):
        pass

    def observe(self, step):
        pass

    def retrieve(self, context, budget):
        tree = random_tree(self.rng, int(self.rng.integers(0, 40)), vocab=6)
        return tree.select(budget)


class RandomDrafter:
    needs, levels = Needs(), 0

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def draft(self, context, budget):
        return random_tree(self.rng, int(self.rng.integers(0, 20)), vocab=6).select(budget)


@pytest.mark.parametrize("tail", [False, True])
def test_graft_keeps_budget_prefix_closure_and_draft_nodes(tail):
    rng = np.random.default_rng(1)
    for trial in range(150):
        budget = int(rng.integers(0, 25))
        proposer = GraftProposer(budget, [RandomRetriever("a", trial), RandomRetriever("b", trial + 1000)],
                                 drafter=RandomDrafter(trial), tail=tail)
        proposer.drafter.rng = np.random.default_rng(trial)
        draft = RandomDrafter(trial).draft([1], budget)
        tree = proposer.propose([1, 2, 3])
        check_tree(tree, max(budget, 0))
        # every draft node survives grafting, at the same path
        assert set(paths_of(draft)) <= set(paths_of(tree))
        record = proposer.trace[-1]
        assert record["draft"] == len(draft) and record["draft"] + record["retrieved"] == len(tree)


def test_retrieved_path_continues_under_the_matching_draft_node():
    class Fixed:
        name, stateless = "fixed", False

        def start(self, prompt): ...

        def observe(self, step): ...

        def retrieve(self, context, budget):
            return Tree.from_paths([[7, 8, 9]], self.name, 0.9)

    class Draft:
        needs, levels = Needs(), 0

        def draft(self, context, budget):
            return Tree.from_paths([[7, 1], [2]], "draft", 0.5)

    proposer = GraftProposer(6, [Fixed()], drafter=Draft())
    proposer.latency.points = {1: 1.0, 64: 1.0}  # verification is free: keep every retrieved node
    tree = proposer.propose([0])
    assert set(paths_of(tree)) == {(7,), (7, 1), (2,), (7, 8), (7, 8, 9)}
    assert tree.nodes[tree.child(ROOT, 7)].source == "fixed"  # the better estimate wins the shared node
    check_tree(tree, 6)


def test_graft_observe_feeds_every_part_and_records_acceptance():
    model = tiny_model(seed=3)
    adjacency = AdjacencyRetriever(97)
    drafter = DraftModelDrafter(tiny_model(seed=4), 97, depth=2, top_k=2)  # 6 draft nodes at most: room is left
    proposer = GraftProposer(12, [PromptLookup(), adjacency], drafter=drafter)
    prompt = [3, 4, 5, 6, 3, 4, 5]
    stats = Stats()
    gen = torch.Generator().manual_seed(0)
    list(engine.decode(Target(model), proposer, prompt, Sampling(), 20, set(), gen, stats))
    assert adjacency.updates == stats.steps + 1  # the prefill and every verification
    assert len(proposer.trace) == stats.steps
    assert sum(sum(r["accepted"].values()) for r in proposer.trace) == sum(stats.accepted.values()) - stats.accepted["bonus"]
    assert stats.times["draft"] > 0 and stats.times["retrieve"] > 0
    assert stats.draft_forwards >= stats.steps


# --- the sampling test through the graft path ---------------------------------------------------------------------
def sample_joint_graft(target_model, draft_model, sampling: Sampling, n: int) -> dict:
    target = Target(target_model)
    proposer = GraftProposer(
        6, [PromptLookup(), AdjacencyRetriever(V)],
        drafter=DraftModelDrafter(draft_model, V, depth=3, top_k=2, prune=PruneSchedule.parse("0:0.5,1:0.4")),
    )
    proposer.latency.points = {1: 1.0, 64: 1.0}
    counts: dict = {}
    for seed in range(321, 321 + n):
        tokens = [t for s in engine.decode(target, proposer, PROMPT, sampling, 3, set(), seed) for t in s]
        counts[(tokens[1], tokens[2])] = counts.get((tokens[1], tokens[2]), 0) + 1
    return counts


@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "topk-topp"])
def test_graft_sampling_preserves_the_distribution(sampling):
    model = tiny_model(seed=11, vocab=V, init=0.08)
    draft = tiny_model(seed=12, vocab=V, init=0.08)
    n = 2000
    counts = sample_joint_graft(model, draft, sampling, n)
    assert not chi_square_rejects(exact_joint(model, sampling), counts, n)


def test_a_draft_without_observe_drops_the_stale_tree_rows_first():
    drafter = SyntheticDrafter(depth=3, top_k=2)
    first = drafter.draft([1, 2], 5)
    assert drafter.tree_rows > 0
    second = drafter.draft([1, 2], 5)  # the mask check inside _grow fails on stale rows
    assert paths_of(first) == paths_of(second)
