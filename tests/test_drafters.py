"""Draft-model drafters through the whole loop: lossless greedy for every method on tiny random target/draft
pairs, the drafter's own KV cache against a fresh forward, vocabulary checks, method wiring, and the real Qwen
pair."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from graft_cli.core import DraftSettings, GraftError, PruneSchedule, Stats, Step, Tree
from graft_cli.method import builder as methods
from plugins.draft_model import DraftModelDrafter, check_vocab
from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.loading import Loaded
from graft_cli.method.builder import MethodConfig
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.tiny import VOCAB, tiny_model


def run(model, proposer, prompt, n, stats=None, stop=frozenset()):
    return [t for s in decode(Target(model), proposer, prompt, Sampling(), n, set(stop), 0, stats) for t in s]


def proposer_for(method: str, draft, budget=12, depth=5, top_k=3) -> GraftProposer:
    prune = PruneSchedule.parse("0:0.35,1:0.25,3:0.15")
    retrievers = [PromptLookup(), AdjacencyRetriever(VOCAB)]
    if method == "dense":
        return GraftProposer(budget, drafter=DraftModelDrafter(draft, VOCAB, depth, top_k))
    if method == "pruned":
        return GraftProposer(budget, drafter=DraftModelDrafter(draft, VOCAB, depth, top_k, prune))
    if method == "graft":
        return GraftProposer(budget, retrievers, drafter=DraftModelDrafter(draft, VOCAB, depth, top_k, prune))
    if method == "chain":
        return GraftProposer(budget, retrievers, drafter=DraftModelDrafter(draft, VOCAB, depth, top_k, prune, chain=True),
                             tail=True)
    if method == "recycling":
        return GraftProposer(budget, [AdjacencyRetriever(VOCAB)])
    raise ValueError(method)


def similar_draft(kind: str, seed: int):
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    target = tiny_model(kind, seed=seed)
    draft = tiny_model(kind, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15)
    return target, draft


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["dense", "pruned", "graft", "chain", "recycling"])
def test_lossless_greedy_on_tiny_pairs(kind, method):
    accepted = 0
    for seed in range(3):
        target, draft = similar_draft(kind, seed)
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 10).tolist()
        prompt = prompt + prompt[:6]  # something for prompt lookup to find
        truth = run(target, GraftProposer(0), prompt, 48)
        stats = Stats()
        assert run(target, proposer_for(method, draft), prompt, 48, stats) == truth
        accepted += sum(stats.accepted.values()) - stats.accepted["bonus"]
        if method != "recycling":
            assert stats.draft_forwards > 0
    assert accepted > 0  # speculation really happened


def test_unrelated_draft_is_still_lossless_and_stops():
    target, draft = tiny_model("llama", seed=7), tiny_model("qwen2", seed=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    truth = run(target, GraftProposer(0), prompt, 40)
    stop = truth[25]
    for method in ("dense", "graft", "chain"):
        got = run(target, proposer_for(method, draft, budget=20, depth=6), prompt, 40, stop={stop})
        assert got == truth[: truth.index(stop) + 1]


def test_draft_cache_holds_exactly_the_context():
    target, draft = similar_draft("llama", 3)
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2)
    proposer = GraftProposer(10, drafter=drafter)
    prompt = list(range(20, 35))
    tokens = run(target, proposer, prompt, 30)
    context = prompt + tokens
    # after the last draft's tree rows are dropped, the cache holds a prefix of the context; feeding the rest
    # must give the same distribution as a fresh forward over the whole context
    drafter._drop_tree([])
    assert drafter.cache.length <= len(context)
    logp, _ = drafter._root(context)
    with torch.no_grad():
        fresh = torch.log_softmax(draft(torch.tensor([context])).logits[0, -1], dim=-1)
    torch.testing.assert_close(logp, fresh, atol=1e-4, rtol=1e-4)
    assert drafter.cache.length == len(context)


def test_a_windowed_draft_reads_the_sink_and_the_tail_and_stays_lossless():
    """A prompt past --draft-window: the draft's cache holds its first SINK tokens and the last window - SINK at
    positions from 0, then the generated tokens; its distribution is a fresh forward over exactly that; the output
    is plain decoding's."""
    from plugins.draft_model import SINK

    target, draft = similar_draft("llama", 3)
    prompt = np.random.default_rng(4).integers(0, VOCAB, 150).tolist()
    truth = run(target, GraftProposer(0), prompt, 40)
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2, window=100)
    assert run(target, GraftProposer(10, [PromptLookup()], drafter=drafter), prompt, 40) == truth
    context = prompt + truth
    drafter._drop_tree([])
    seen = context[:SINK] + context[SINK + 50 :]
    logp, _ = drafter._root(context)
    with torch.no_grad():
        fresh = torch.log_softmax(draft(torch.tensor([seen])).logits[0, -1], dim=-1)
    torch.testing.assert_close(logp, fresh, atol=1e-4, rtol=1e-4)
    assert drafter.cache.length == len(seen) and drafter.skipped == 50


def test_accepted_draft_rows_are_kept_not_refed():
    """With a draft equal to the target every drafted node is accepted; only the bonus token is fed again."""
    target = tiny_model("llama", seed=5)
    drafter = DraftModelDrafter(tiny_model("llama", seed=5), VOCAB, depth=4, top_k=1)
    proposer = GraftProposer(8, drafter=drafter)
    stats = Stats()
    prompt = list(range(10))
    run(target, proposer, prompt, 41, stats)
    assert stats.accept_lengths == [5] * 8
    assert stats.draft_forwards == 8 * 4  # one per level, and the root forward feeds one token


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_vocabulary_mismatch_is_a_clear_error():
    check_vocab(FakeTokenizer({"a": 0, "b": 1}), FakeTokenizer({"a": 0, "b": 1}), "same")
    with pytest.raises(GraftError, match="does not share the target's tokenizer"):
        check_vocab(FakeTokenizer({"a": 0, "b": 1}), FakeTokenizer({"a": 1, "b": 0}), "other")


def tiny_loaded(model) -> Loaded:
    return Loaded(model, None, Path("."), "tiny")


def test_method_wiring(monkeypatch):
    loaded = tiny_loaded(tiny_model(seed=1))
    seen = {}

    def fake_drafter(kind, env):
        seen.update(kind=kind, spec=env.spec, depth=env.settings.depth, top_k=env.settings.draft_top_k, prune=env.prune, chain=env.settings.chain)
        return DraftModelDrafter(tiny_model(seed=2), VOCAB, env.settings.depth, env.settings.draft_top_k, env.prune, env.settings.chain)
    monkeypatch.setattr(methods, "load_drafter", fake_drafter)
    names = {}
    real = methods.make_retrievers

    def recording(n, env):  # the suffix-array store belongs to another test: only its name is checked here
        names["last"] = list(n)
        return real([x for x in n if x != "suffix-array"], env)

    monkeypatch.setattr(methods, "make_retrievers", recording)

    p = methods.build(MethodConfig("dense", 10, draft="d", drafting=DraftSettings(depth=3, draft_top_k=2)), loaded)
    assert p.drafter is not None and seen["prune"] is None and names["last"] == [] and p.budget == 10
    assert (seen["kind"], seen["spec"], seen["depth"], seen["top_k"]) == ("model", "d", 3, 2)  # a bare name: a model
    p = methods.build(MethodConfig("pruned", draft="d", drafting=DraftSettings(prune_at="0:0.5")), loaded)
    assert seen["prune"] == PruneSchedule.parse("0:0.5", floor=0.1) and p.budget == 16  # the CPU defaults
    p = methods.build(MethodConfig("graft", draft="d", tree="fixed", drafting=DraftSettings(chain=True)), loaded)
    assert seen["prune"] == PruneSchedule.default() and seen["chain"] and p.tail
    p = methods.build(MethodConfig("graft", draft="d", drafting=DraftSettings(chain=True)), loaded)  # by cost: the floor, no checkpoints
    assert seen["prune"] == PruneSchedule.parse("none", floor=0.1) and p.objective is not None
    assert [r.name for r in p.retrievers] == ["prompt", "recycling"]
    names.clear()
    methods.build(MethodConfig("graft", options={"datastore": "somewhere"}), loaded)
    assert names["last"] == ["prompt", "recycling", "suffix-array"]
    p = methods.build(MethodConfig("recycling"), loaded)
    assert p.drafter is None and [r.name for r in p.retrievers] == ["recycling"]
    assert methods.build(MethodConfig("graft"), loaded).drafter is None  # no --draft: retrievers only
    for bad in [MethodConfig("dense"), MethodConfig("pruned"), MethodConfig("pld", draft="d"),
                MethodConfig("dense", draft="d", drafting=DraftSettings(prune_at="0:0.3")), MethodConfig("graft", drafting=DraftSettings(chain=True)),
                MethodConfig("nope")]:
        with pytest.raises(GraftError):
            methods.build(bad, loaded)


# --- the real pair ------------------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_real_qwen_pair_is_lossless(monkeypatch):
    from graft_cli.runtime.loading import encode, load_model, stop_ids

    # Packing would double the pair's 9 GB of fp32 weights (the suite must peak under 12 GB); the packed kernels
    # are checked on the tiny models and on SmolLM2 (tests/test_cpu_linear.py, tests/test_real_model.py).
    monkeypatch.setenv("GRAFT_CPU_PACK", "0")

    target = load_model("qwen2.5-coder-1.5b-instruct", "cpu", "float32")
    config = MethodConfig("graft", 8, draft="qwen2.5-coder-0.5b-instruct", drafting=DraftSettings(depth=4, draft_top_k=2))
    proposer = methods.build(config, target)
    stop = stop_ids(target)
    # One prompt of 16 tokens: each step verifies its tree over unpacked fp32 weights, minutes for more.
    ids = encode(target.tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    ar = [t for s in decode(Target(target.model), GraftProposer(0), ids, Sampling(), 16, stop, 0) for t in s]
    stats = Stats()
    got = [t for s in decode(Target(target.model), proposer, ids, Sampling(), 16, stop, 0, stats) for t in s]
    assert got == ar
    assert stats.accepted["draft"] > 5  # the 0.5B model really drafts for the 1.5B one


def test_a_reduced_draft_vocabulary_drafts_only_its_ids_and_stays_lossless():
    from plugins.draft_model import draft_vocab

    class Tok:
        all_special_ids = [VOCAB - 1]
        added_tokens_decoder = {VOCAB - 2: None}

    vocab = draft_vocab(Tok(), VOCAB, 40)
    assert vocab.tolist() == [*range(40), VOCAB - 2, VOCAB - 1]
    assert draft_vocab(Tok(), VOCAB, 0) is None and draft_vocab(Tok(), VOCAB, VOCAB) is None
    target, draft = tiny_model(seed=1), tiny_model(seed=1)  # the draft is the target: a perfect drafter
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2, vocab=vocab)
    prompt = list(range(5, 17))
    truth = run(target, GraftProposer(0), prompt, 40)
    stats = Stats()
    assert run(target, GraftProposer(8, drafter=drafter), prompt, 40, stats) == truth
    assert drafter.pool.nodes and all(node.token in set(vocab.tolist()) for node in drafter.pool.nodes)
    assert stats.accepted["draft"] > 0


def test_a_draft_model_keeps_what_it_read_of_the_last_request_when_the_next_begins_with_it():
    """A conversation's next turn repeats the last: the draft reads only what is new, and drafts as if it had
    read everything (the same first tree as a fresh drafter's), across a cache that must grow."""
    target, draft = tiny_model(seed=1), tiny_model(seed=2)
    first = list(range(5, 17))
    drafter = DraftModelDrafter(draft, VOCAB, depth=3, top_k=2)
    answer = run(target, GraftProposer(8, drafter=drafter), first, 12)
    assert answer == run(target, GraftProposer(0), first, 12)
    turn = [*first, *answer[:-1], 40, 41, 42]  # the last answer back, but its last token, then a new question
    assert run(target, GraftProposer(8, drafter=drafter), turn, 60) == run(target, GraftProposer(0), turn, 60)
    assert drafter.kept == len(first) + len(answer) - 1  # and the cache grew past the first request's rows
    again = DraftModelDrafter(draft, VOCAB, depth=3, top_k=2)
    run(target, GraftProposer(8, drafter=again), first, 12)
    again.start(turn, Step(turn, [], Tree(), [], None, None), len(turn) + 80)
    cold = DraftModelDrafter(draft, VOCAB, depth=3, top_k=2)
    cold.start(turn, Step(turn, [], Tree(), [], None, None), len(turn) + 80)
    assert again.unread([*turn, 7]) == 4 and cold.unread([*turn, 7]) == len(turn) + 1
    a, b = (d.draft([*turn, 7], 8) for d in (again, cold))
    assert [(n.token, n.parent) for n in a.nodes] == [(n.token, n.parent) for n in b.nodes]
    assert [n.score for n in a.nodes] == pytest.approx([n.score for n in b.nodes], rel=1e-4)


# --- the tensor drafter against the per-node algorithm it replaced ---------------------------------------------
def reference_draft(drafter, context, budget):
    """EAGLE-2 with a per-node pool, as TreeDrafter.draft was written before its pool moved to the device: the
    tree, the pool, the fed rows, levels, the stopping checkpoint and the forwards, through drafter's own
    _root/_grow (it keeps drafter.tree_rows as draft does)."""
    from graft_cli.core import ROOT, Tree

    pool, fed, k, prune = Tree(), {}, drafter.top_k, drafter.prune
    logp, states = drafter._root(context)
    forwards, levels, keep, stopped = 1, 1, budget, None
    values, ids = torch.topk(logp.float(), min(k, logp.shape[-1]))
    tokens = drafter._to_target(ids).tolist()
    frontier = [pool.add(ROOT, t, "draft", math.exp(c)) for t, c in zip(tokens, values.tolist())]
    cum, parent_state = values.tolist(), [0] * len(frontier)
    while True:
        level = levels - 1
        if drafter.chain:
            if math.exp(cum[0]) < (prune.chain_threshold(level) if prune else 0.0):
                keep = min(keep, len(pool) - 1)
                break
        elif prune is not None and prune.stops(level, max(cum)) is not None:
            stopped = prune.at(level)
            keep = prune.keep(stopped, budget)
            break
        if levels >= drafter.depth:
            break
        if prune is not None and prune.floor > 0 and not drafter.chain:
            worth = [i for i, c in enumerate(cum) if c >= math.log(prune.floor)]
            frontier, cum = [frontier[i] for i in worth], [cum[i] for i in worth]
            parent_state = [parent_state[i] for i in worth]
        if not frontier:
            break
        if len(pool) >= keep and sorted((n.score for n in pool.nodes), reverse=True)[keep - 1] > math.exp(max(cum)):
            break
        n = len(frontier)
        mask = torch.zeros((n, drafter.tree_rows + n), dtype=torch.bool)
        for i, node in enumerate(frontier):
            parent = pool.nodes[node].parent
            while parent != ROOT:
                mask[i, fed[parent]] = True
                parent = pool.nodes[parent].parent
            mask[i, drafter.tree_rows + i] = True
        tokens = torch.tensor([pool.nodes[i].token for i in frontier])
        logp, states = drafter._grow(tokens, None if states is None else states[parent_state], levels, mask)
        forwards += 1
        for i, node in enumerate(frontier):
            fed[node] = drafter.tree_rows + i
        drafter.tree_rows += n
        levels += 1
        values, ids = torch.topk(logp.float(), min(k, logp.shape[-1]), dim=-1)
        total = (torch.tensor(cum)[:, None] + values).flatten()
        children = drafter._to_target(ids).flatten().tolist()
        added = [pool.add(frontier[b // values.shape[1]], t, "draft", math.exp(c))
                 for b, (t, c) in enumerate(zip(children, total.tolist()))]
        best = torch.topk(total, min(k, total.numel())).indices.tolist()
        frontier, cum = [added[b] for b in best], [total[b].item() for b in best]
        parent_state = [b // values.shape[1] for b in best]
    return pool.select(keep), pool, fed, levels, stopped, forwards


def nodes_of(tree):
    return [(n.token, n.parent, n.depth, n.source, n.score) for n in tree.nodes]


def assert_same_draft(new, old, context, budget):
    """Both drafters (same weights, same history) draft ``context``; everything the loop sees must agree."""
    stats = Stats()
    new.recorder.begin(stats)
    tree = new.draft(context, budget)
    ref, pool, fed, levels, stopped, forwards = reference_draft(old, context, budget)
    assert nodes_of(tree) == nodes_of(ref)
    assert nodes_of(new.pool) == nodes_of(pool) and new.fed == fed and new.tree_rows == old.tree_rows
    assert (new.levels, new.stopped_at, stats.draft_forwards) == (levels, stopped, forwards)
    return tree, pool, fed


SCHEDULES = {
    "dense": dict(),
    "pruned": dict(prune=PruneSchedule.parse("0:0.5,1:0.4,2:0.3")),
    "floor": dict(prune=PruneSchedule.parse("none", floor=0.05)),
    "pruned+floor": dict(prune=PruneSchedule.parse("0:0.2,1:0.15,3:0.1", floor=0.02)),
    "chain": dict(prune=PruneSchedule.parse("0:0.3,2:0.2"), chain=True),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tensor_pool_matches_the_per_node_algorithm_on_synthetic_logits(schedule):
    """Path-determined random logits (flat to peaked) over many budgets: checkpoints, the floor, chains and
    settled pools all fire somewhere, and tree, pool, fed rows and counts stay those of the per-node code."""
    from tests.test_graft import SyntheticDrafter

    fired = set()
    for seed in range(24):
        rng = np.random.default_rng(seed)
        depth, k, budget = int(rng.integers(1, 8)), int(rng.integers(1, 6)), int(rng.integers(1, 70))
        peak = float(rng.choice([0.0, 0.5, 1.0, 2.0, 4.0]))  # 0: uniform, every sibling ties
        new, old = (SyntheticDrafter(depth=depth, top_k=k, peak=peak, **SCHEDULES[schedule]) for _ in range(2))
        context = rng.integers(0, 12, 4).tolist()
        tree, pool, _ = assert_same_draft(new, old, context, budget)
        fired.add("stopped" if new.stopped_at else "deep" if new.levels == depth else "early")
    assert len(fired) >= 2 or schedule == "dense"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tensor_pool_matches_the_per_node_algorithm_on_a_tiny_model(schedule):
    """Two draft models with the same weights, one drafting the new way, one the old, step after step: the
    trees, the KV-cache rows kept after each (pretend) verification and the cache lengths stay equal."""
    from graft_cli.core import ROOT

    for init in (0.02, 0.3):  # flat distributions (early stops) and peaked ones (deep trees)
        model = tiny_model("llama", seed=11, init=init)
        new, old = (DraftModelDrafter(model, VOCAB, depth=6, top_k=4, **SCHEDULES[schedule]) for _ in range(2))
        rng = np.random.default_rng(3)
        prompt = rng.integers(0, VOCAB, 12).tolist()
        for drafter in (new, old):
            drafter.start(prompt, None, len(prompt) + 256)
        context = prompt + [int(rng.integers(0, VOCAB))]  # the prefill's token: the first root
        for step in range(6):
            tree, pool, fed = assert_same_draft(new, old, context, int(rng.integers(4, 40)))
            path, node = [], ROOT  # accept a random branch of the tree, then a bonus token
            while tree.children(node) and rng.random() < 0.8:
                node = int(rng.choice(tree.children(node)))
                path.append(tree.nodes[node].token)
            rows = []
            for n in pool.follow(path):
                if n not in fed:
                    break
                rows.append(fed[n])
            assert new._accepted_rows(path) == rows
            context = context + path + [int(rng.integers(0, VOCAB))]
            new.observe(Step(context, path + [context[-1]], tree, []))
            old._drop_tree(rows)
            assert new.cache.length == old.cache.length
