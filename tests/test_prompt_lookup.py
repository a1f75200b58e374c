"""The prompt-local cache: ranked continuations of the longest matching suffix, and its own calibration."""

from __future__ import annotations

from graft_cli.core import ROOT, Step, Tree
from plugins.prompt_lookup import PromptLookup


def test_every_occurrence_of_the_longest_match_contributes_ranked_by_count():
    cache = PromptLookup(max_length=3)
    cache.start([1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 5, 2, 3, 5, 1, 2, 3])
    tree = cache.retrieve([1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 5, 2, 3, 5, 1, 2, 3], 10)
    first = sorted(((n.score, n.token) for n in tree.nodes if n.parent == ROOT), reverse=True)
    assert [token for _, token in first] == [4]  # "1 2 3" was followed by 4 twice; "2 3 5" is a shorter match
    assert {tree.nodes[i].token for i in tree.children(tree.child(ROOT, 4))} == {9, 7}


def test_follow_walks_the_tree_along_tokens():
    tree = Tree()
    a = tree.add(ROOT, 5, "x", 0.5)
    b = tree.add(a, 6, "x", 0.4)
    tree.add(ROOT, 7, "x", 0.3)
    assert tree.follow([5, 6, 1]) == [a, b]
    assert tree.follow([8]) == []


def test_short_matches_that_miss_lose_trust_and_long_ones_keep_it():
    cache = PromptLookup(max_length=2)
    context = [1, 9, 4, 5, 6, 7, 4, 5, 6]
    cache.start(context)
    long_score = cache.retrieve(context, 4).nodes[0].score  # "4 5 6": a 3-token match, 7 follows
    for r in range(30):  # a fresh token, then 1: only a one-token match, and the target never continues it so
        context = [*context, 100 + 2 * r, 1]
        naive = cache.retrieve(context, 4)
        accepted = [101 + 2 * r]
        cache.observe(Step([*context, *accepted], accepted, Tree(), []))
        context = [*context, *accepted]
    short_score = cache.retrieve([*context, 999, 1], 4).nodes[0].score
    assert short_score < 0.15 and naive.nodes[0].raw >= 0.1  # the counts alone still vouch for it
    assert cache.calibration.calibration.ratio("match1", 1) < 0.3
    assert cache.calibration.calibration.ratio("match3", 1) == 1.0  # no longer lookup was judged
    assert long_score >= 0.5


def test_a_long_prompt_gives_the_trie_of_a_full_scan():
    """The index against a brute-force scan of every earlier occurrence of the longest matching suffix."""
    import numpy as np

    from datastores.suffix_array import SEP, continuation_trie
    from plugins.calibration import LookupCalibration, match_group
    from plugins.store_retriever import to_tree

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 12, 8000).tolist()  # a small alphabet: every short n-gram recurs hundreds of times
    cache = PromptLookup(max_match=4, max_length=5, max_matches=8)
    cache.start(prompt)
    for cut in (4000, 6000, 8000):
        context = prompt[:cut]
        last = cut - 1
        for n in range(4, 0, -1):
            suffix = context[last - n + 1 :]
            ends = [e for e in range(n - 1, last) if context[e - n + 1 : e + 1] == suffix]
            if ends:
                break
        conts = [context[e + 1 : e + 6] for e in ends[-8:]]
        rows = np.full((len(conts), max(map(len, conts))), SEP, dtype=np.uint32)
        for row, cont in zip(rows, conts):
            row[: len(cont)] = cont
        want = LookupCalibration().apply(to_tree(continuation_trie(rows, 16), "prompt"), cut, match_group(n))
        got = PromptLookup(max_match=4, max_length=5, max_matches=8)
        got.start(context)
        tree = got.retrieve(context, 16)
        assert [(x.parent, x.token, x.score) for x in tree.nodes] == [(x.parent, x.token, x.score) for x in want.nodes]


def test_periodic_continues_a_match_that_runs_into_the_context_end():
    """A loop the context has just begun: the only occurrence of the suffix ends 2 tokens back, so its
    continuation is cut by the context's end unless it repeats."""
    context = [9, 1, 2, 1, 2, 1]

    def best_path(cache: PromptLookup) -> list[int]:
        cache.start(context)
        tree, path, parent = cache.retrieve(context, 32), [], ROOT
        while kids := tree.children(parent):
            parent = max(kids, key=lambda i: tree.nodes[i].score)
            path.append(tree.nodes[parent].token)
        return path

    assert best_path(PromptLookup(min_match=2, max_length=6)) == [2, 1]
    assert best_path(PromptLookup(min_match=2, max_length=6, periodic=True)) == [2, 1, 2, 1, 2, 1]
    long = PromptLookup(min_match=2, max_length=3, periodic=True)  # one that does not reach the end stays as it is
    long.start([1, 2, 3, 4, 5, 6, 1, 2])
    assert [n.token for n in long.retrieve([1, 2, 3, 4, 5, 6, 1, 2], 8).nodes] == [3, 4, 5]
