import numpy as np

from graft_cli.core import ROOT, Tree


def test_add_merges_duplicate_siblings_and_keeps_best_score():
    t = Tree()
    a = t.add(ROOT, 5, "draft", 0.5)
    assert t.add(ROOT, 5, "prompt", 0.7) == a
    assert len(t) == 1 and t.nodes[a].score == 0.7 and t.nodes[a].source == "prompt"


def test_child_scores_never_exceed_parent():
    t = Tree()
    a = t.add(ROOT, 1, "x", 0.3)
    b = t.add(a, 2, "x", 0.9)
    assert t.nodes[b].score == 0.3


def test_mask_positions_and_paths():
    t = Tree()
    a = t.add(ROOT, 1, "x", 0.9)
    b = t.add(a, 2, "x", 0.8)
    c = t.add(ROOT, 3, "x", 0.5)
    mask = t.ancestor_mask()
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, True],
    ]
    assert t.depths().tolist() == [0, 1, 2, 1]
    assert sorted(t.paths()) == [[a, b], [c]]


def random_tree(rng: np.random.Generator, n: int, vocab: int = 20) -> Tree:
    t = Tree()
    for _ in range(n):
        parent = ROOT if not len(t) or rng.random() < 0.3 else int(rng.integers(len(t)))
        t.add(parent, int(rng.integers(vocab)), "s", float(rng.random()))
    return t


def test_select_and_graft_keep_invariants_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = random_tree(rng, int(rng.integers(1, 40)))
        budget = int(rng.integers(0, 30))
        s = t.select(budget)
        assert len(s) == min(budget, len(t))
        check_invariants(s)
        base = random_tree(rng, int(rng.integers(0, 10)))
        before = len(base)
        base.graft(t, max(budget, before))
        assert len(base) <= max(budget, before)
        check_invariants(base)


def check_invariants(t: Tree) -> None:
    seen = set()
    for i, node in enumerate(t.nodes):
        assert node.parent < i  # topological order, prefix-closed
        assert (node.parent, node.token) not in seen  # no duplicate siblings
        seen.add((node.parent, node.token))
        if node.parent != ROOT:
            assert node.depth == t.nodes[node.parent].depth + 1
            assert node.score <= t.nodes[node.parent].score
