"""The cost-aware tree builder (graft_cli/drafting/objective.py): its decisions on known numbers, the retrieved chain
checked in the draft's first forward (exact keys and values for a draft model), and lossless generation with
draft models and EAGLE-3 heads, greedy and sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.core import DraftSettings, GraftError, PruneSchedule, Stats
from graft_cli.method import builder as methods
from graft_cli.drafting.budget import LatencyModel
from plugins.draft_model import DraftModelDrafter
from graft_cli.heads import load_head
from plugins.eagle3 import Eagle3Drafter
from graft_cli.runtime.engine import decode
from graft_cli.drafting import CostAwareProposer, GraftProposer
from graft_cli.method.builder import MethodConfig
from graft_cli.drafting.objective import EVIDENCE, EXPLORE, HORIZON, TRIAL, Objective
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.test_drafters import similar_draft, tiny_loaded
from tests.test_eagle3 import target_model, write_head
from tests.tiny import VOCAB, tiny_model

FLAT = LatencyModel({1: 1.0, 8: 1.0, 16: 1.5, 32: 3.0})


def run(model, proposer, prompt, n, stats=None, sampling=Sampling(), seed=0):
    return [t for s in decode(Target(model), proposer, prompt, sampling, n, set(), seed, stats) for t in s]


def cost_proposer(drafter, budget=16, retrievers=None):
    retrievers = [PromptLookup(), AdjacencyRetriever(VOCAB)] if retrievers is None else retrievers
    return CostAwareProposer(budget, retrievers, drafter=drafter, latency=FLAT, objective=Objective(FLAT))


# --- decisions on known numbers ---------------------------------------------------------------------------------
def test_the_best_count_and_the_next_level():
    objective = Objective(FLAT)
    plan = objective.best(np.array([0.9, 0.8, 0.7, 0.01]), 0.0)
    assert plan.count == 4 and plan.rate == pytest.approx(3.41)  # verification is flat up to 8 tokens here
    # at 3.41 tokens a unit, a level costing 0.35 units must add 1.2 tokens: 0.8 x (0.7 + 0.2) is too little
    assert not objective.extend(np.array([0.7, 0.2]), plan, 0.0)
    assert objective.extend(np.array([1.0, 1.0]), plan, 0.0)
    weak = objective.best(np.array([0.5]), 0.0)  # 1.5 tokens a unit: the same level now pays
    assert objective.extend(np.array([0.7, 0.2]), weak, 0.0)
    assert not objective.extend(np.array([0.05]), weak, 0.0)  # an unlikely one does not
    assert not objective.extend(np.array([]), weak, 0.0)
    objective.confidence = 0.0  # a drafter that is never right is never worth a level
    assert not objective.extend(np.array([1.0, 1.0]), weak, 0.0)


def test_the_drafts_calibration_is_measured_per_probability_bin_on_the_tokens_the_target_read():
    """A drafted token counts in its bin (its probability given its parent) when the target read it: every token
    up to and including the first rejected one; those after it tell nothing."""
    objective = Objective(FLAT)
    line = [0.5, 0.25, 0.125, 0.0625]  # each token 0.5 likely given its parent
    assert objective.calibrated(line) == pytest.approx(line)  # unmeasured: the draft's own probabilities
    for _ in range(40):
        objective.observe_draft(line, 4)  # a draft right far more often than it says
    assert objective.accepts(np.array([0.5]))[0] > 0.9
    assert objective.calibrated(line)[-1] > 0.6
    assert objective.accepts(np.array([0.99]))[0] == pytest.approx(0.99)  # another bin: not moved
    for _ in range(40):
        objective.observe_draft([0.995, 0.99, 0.985], 1)  # sure of itself, rejected at its second token
    assert objective.accepts(np.array([0.995]))[0] < 0.6
    before = objective._tested.copy()
    objective.observe_draft([0.995, 0.99, 0.985], 0)  # rejected at once: only the first token was read
    assert (objective._tested - 0.97 * before).sum() == pytest.approx(1.0)


def test_a_step_that_goes_well_is_not_cut_short_once_the_going_rate_is_known():
    """Before drafting is measured a level pays when it raises the step's own rate; after, when it beats what
    time buys on average (drafting's pooled rate), whatever the step has already reached."""
    objective = Objective(FLAT)
    plan = objective.best(np.array([0.99] * 7), 0.3 * 7)  # 7 sure levels drafted: 7.9 tokens for 3.1 units
    assert objective.going() is None and not objective.extend([0.9, 0.05], plan, 0.3 * 7)
    for _ in range(EVIDENCE):
        objective.measured(1, True, 4, 8, 0.1, 0.03, [1, 1, 1])  # drafting reaches 4 tokens in 1.3 units
    assert objective.going() == pytest.approx(objective.drafting_rate())
    assert objective.extend([0.9, 0.05], plan, 0.3 * 7)  # 0.8 x 0.95 tokens for 0.3 units beats 3 a unit
    # the verified nodes too: a weak node (its row costs 0.06 units past 8) does not ride on a step whose long
    # drafting is sunk, as it would on the step's own low rate
    scores = np.array([0.99] * 7 + [0.05])
    assert objective.best(scores, 10.0).count == 7
    assert Objective(FLAT).best(scores, 10.0).count == 8


def test_retrieval_alone_is_not_tried_where_it_is_plain_decoding():
    objective = Objective(FLAT)
    objective.measured(1, True, 4, 8, 0.1, 0.03, [1, 1, 1])
    assert objective.should_draft(1)  # bucket 1 expects the bonus token alone: never worth a step
    objective.measured(6, True, 4, 8, 0.1, 0.03, [1, 1, 1])
    assert not objective.should_draft(6)  # six tokens for one forward could win: try it
    for _ in range(4):
        objective.measured(6, False, 1, 8, 0.1, 0.0, [])  # retrieval alone delivers a sixth of its promise
    assert objective.retrieval_share() < 0.4 and objective.should_draft(6)


def test_a_planned_draft_walks_its_levels_after_one_read():
    """The walk takes the per-level rule's decisions from the levels' read values: it stops where the rule stops
    (that depth is the next draft's), or plans one level deeper when every level still paid."""
    objective = Objective(FLAT, max_levels=6, planned=True)
    sure, weak = [np.log(0.9)] * 2, [np.log(0.02)] * 2
    pool = [np.log(0.9), np.log(0.8), np.log(0.7)]
    count = objective.replan([(sure, pool[:2]), (sure, pool), (weak, pool), (weak, pool)], [1, 2, 2, 2])
    assert objective.levels == 3  # the third level's frontier was not worth its forward
    assert count == objective.best(np.exp(np.array(pool)), 4 * 0.35).count == 3
    objective.replan([(sure, pool)] * 2, [1, 2])
    assert objective.levels == 3  # every level paid: one deeper next time
    objective.replan([(sure, pool)] * 6, [1] + [2] * 5)
    assert objective.levels == 6  # never past max_levels


def test_costs_come_from_measurements():
    objective = Objective(FLAT)
    assert objective.draft_cost(1) == pytest.approx(0.35)  # the prior, in one-token forwards
    objective.measured(2, True, 5, 7, verify_s=0.2, draft_s=0.3, draft_rows=[1, 1, 1])
    assert objective.unit == pytest.approx(0.2)  # seconds per curve unit (8 tokens cost 1.0)
    assert objective.draft_cost(1) == pytest.approx(0.5)  # 0.1 s a forward = half a verification
    assert objective.spent(0.4, [1]) == pytest.approx(2.0)
    assert objective.rate(2, True) == pytest.approx(5 / 2.5)
    for _ in range(2):
        objective.measured(2, True, 5, 7, verify_s=0.2, draft_s=0.3, draft_rows=[1, 1, 1])
    objective.measured(2, True, 5, 7, verify_s=2.0, draft_s=3.0, draft_rows=[1, 1, 1])  # a busy moment
    assert objective.unit == pytest.approx(0.2) and objective.draft_cost(1) == pytest.approx(0.5)  # medians
    assert objective.rate(2, True) == pytest.approx(5 / 2.5)  # the same work costs the same


def test_the_bandit_tries_both_modes_then_keeps_the_faster_but_still_looks():
    objective = Objective(FLAT)
    assert objective.should_draft(3)  # nothing measured: draft
    objective.measured(3, True, 4, 8, 0.1, 0.3, [1, 1, 1])  # drafting: 4 tokens for 1 + 3 x 1 units
    assert not objective.should_draft(3)  # not drafting is unmeasured: try it
    objective.measured(3, False, 3, 8, 0.1, 0.0, [])  # 3 tokens for 1 unit: faster
    assert not objective.should_draft(3)
    for _ in range(EXPLORE):
        objective.measured(3, False, 3, 8, 0.1, 0.0, [])
    assert objective.should_draft(3)  # the loser is looked at again
    assert objective.should_draft(7)  # another confidence bucket knows nothing yet


def test_one_failed_draft_does_not_shut_drafting_out_of_a_bucket():
    """A bucket's rates lean on what each mode is expected to reach there: drafting's pooled rate, and the
    bucket's expected tokens for retrieval alone; a bucket seen for long trusts what it measured."""
    objective = Objective(FLAT)
    for _ in range(EVIDENCE):
        objective.measured(1, True, 8, 8, 0.1, 0.03, [1, 1, 1])  # 8 tokens for 1.33 units (forwards: 0.1)
    objective.measured(2, False, 3, 8, 0.1, 0.0, [])  # retrieval alone, lucky: 3 tokens a unit
    objective.measured(2, True, 1, 8, 0.1, 0.03, [1, 1, 1])  # the draft failed once there
    assert objective.should_draft(2)
    for _ in range(EVIDENCE):
        objective.measured(2, True, 1, 8, 0.1, 0.03, [1, 1, 1])
    assert not objective.should_draft(2)


def test_a_drafter_joins_a_request_only_when_finishing_faster_pays_for_its_prompt():
    objective = Objective(FLAT)
    weaker = (TRIAL, 2.0 * TRIAL, TRIAL)  # retrieval alone: 0.5 tokens a unit
    strong = (4 * TRIAL, float(TRIAL), TRIAL)  # 4 tokens a unit: a summary copying its article
    assert objective.should_join((0, 0.0, 0), rows=500, remaining=100)  # drafting never measured: learn it
    for _ in range(EVIDENCE - 1):
        objective.measured(3, True, 4, 8, 0.1, 0.3, [1, 1, 1])  # drafting: 4 tokens for 1 + 3 x 1 units = 1 a unit
    assert objective.should_join(strong, rows=500, remaining=1)  # too few drafted steps yet
    objective.measured(3, True, 4, 8, 0.1, 0.3, [1, 1, 1])
    assert objective.drafting_rate() == pytest.approx(4 / 4.25)  # a forward and a verification: 1.0625 units each
    assert not objective.should_join((0, 0.0, 0), rows=10, remaining=100)
    weak = (TRIAL, float(TRIAL), TRIAL)  # retrieval alone: 1 token a unit, as fast as drafting
    assert not objective.should_join(weak, rows=10, remaining=100)
    assert objective.should_join(weaker, rows=64, remaining=100)  # 100 tokens save ~40 units; 64 rows cost 1.2
    assert not objective.should_join(weaker, rows=64, remaining=1)  # not this close to the end
    assert not objective.should_join(strong, rows=10, remaining=100)
    lucky = Objective(FLAT)
    for _ in range(EVIDENCE - 1):
        lucky.measured(3, True, 4, 8, 0.1, 0.3, [1, 1, 1])
    lucky.measured(7, True, 40, 8, 0.1, 0.0, [])  # one lucky step in a rare bucket: 40 tokens a unit
    assert lucky.rate(7, True) > 5 * lucky.rate(3, True)  # a mean over buckets would take it at its word (~20)
    assert lucky.drafting_rate() < 2  # pooled over steps it is one step of 16
    assert not lucky.should_join((2 * TRIAL, float(TRIAL), TRIAL), rows=10, remaining=100)  # retrieval: 2 a unit


def test_a_long_prompt_is_read_only_once_its_answer_has_run_long_enough_to_pay_for_it():
    """A request is expected to run as long again as it has (at least ``HORIZON`` tokens, never past its limit),
    so a drafter joins a 500-token prompt only once the answer is long, where reading 64 tokens pays at once."""
    assert Objective.expected_remaining(5, 500) == HORIZON
    assert Objective.expected_remaining(80, 500) == 80
    assert Objective.expected_remaining(80, 20) == 20
    objective = Objective(FLAT)
    for _ in range(EVIDENCE):
        objective.measured(3, True, 4, 8, 0.1, 0.3, [1, 1, 1])  # drafting: 0.94 tokens a unit
    weaker = (TRIAL, 2.0 * TRIAL, TRIAL)  # retrieval alone: 0.5 tokens a unit
    joins = {rows: [objective.should_join(weaker, rows, objective.expected_remaining(written, 500))
                    for written in (5, 32, 64, 128)] for rows in (64, 500)}
    assert joins == {64: [True] * 4, 500: [False, False, False, True]}


class Clocked(Objective):
    """Timings on a modelled clock (a verification: 10 ms per curve unit; a draft row: 0.35 of that), so that
    the decisions do not follow this machine's speed."""

    def measured(self, bucket, drafted, tokens, nodes, verify_s, draft_s, draft_rows):
        shape = sum(self.latency(r) for r in draft_rows) / self.latency(1)
        super().measured(bucket, drafted, tokens, nodes, 0.01 * self.verify_cost(nodes), 0.0035 * shape, draft_rows)


def joining(target, draft, drafted_tokens: int) -> tuple[CostAwareProposer, DraftModelDrafter]:
    """A cost-aware proposer whose earlier requests measured drafting at ``drafted_tokens`` a step."""
    drafter = DraftModelDrafter(draft, VOCAB, depth=24, top_k=2, prune=PruneSchedule((), 0.1))
    proposer = CostAwareProposer(16, [PromptLookup(), AdjacencyRetriever(VOCAB)], drafter=drafter, latency=FLAT,
                                 objective=Clocked(FLAT))
    for bucket in range(EVIDENCE):
        proposer.objective.measured(1 + bucket % 8, True, drafted_tokens, 8, 0.0, 0.0, [1, 1, 1])
    return proposer, drafter


def test_a_draft_model_never_reads_a_request_that_retrieval_carries():
    """A new request whose prompt holds its answer never prefills a draft model that drafted slower than that;
    where retrieval finds nothing, it joins: within the trial steps when the prompt is cheaper to read than a
    target forward, after them when it is not. Every text is plain decoding's."""
    target, draft = similar_draft("llama", 1)
    greedy = run(target, GraftProposer(0), list(range(40, 52)), 40)
    prompt = list(range(40, 52)) + greedy  # plain decoding's own continuation, already in the prompt
    truth = run(target, GraftProposer(0), prompt, 30)
    proposer, drafter = joining(target, draft, drafted_tokens=2)
    assert run(target, proposer, prompt, 30) == truth
    assert not drafter.joined and not any(r["levels"] for r in proposer.trace)
    for rows, trial in ((24, False), (64, True)):  # reading 24 rows: 0.79 of a target forward; 64: 2.0
        noise = np.random.default_rng(5).integers(0, VOCAB, rows).tolist()
        truth = run(target, GraftProposer(0), noise, 40)
        proposer, drafter = joining(target, draft, drafted_tokens=6)
        assert (proposer.objective.draft_cost(rows) > proposer.objective.verify_cost(0)) is trial
        assert run(target, proposer, noise, 40) == truth
        levels = [r["levels"] for r in proposer.trace]
        assert drafter.joined and any(levels[:TRIAL]) is not trial, levels
    sampling = Sampling(temperature=0.8, top_k=20)  # joining mid-request changes no sampled token either
    truth = run(target, GraftProposer(0), noise, 40, sampling=sampling, seed=1)
    proposer, drafter = joining(target, draft, drafted_tokens=6)
    assert run(target, proposer, noise, 40, sampling=sampling, seed=1) == truth and drafter.joined


def test_retrieval_confidence_buckets():
    objective = Objective(FLAT)
    assert objective.bucket(np.array([])) == 1
    assert objective.bucket(np.array([0.9, 0.9, 0.9])) == 4
    assert objective.bucket(np.ones(30)) == 8


# --- the checked chain ------------------------------------------------------------------------------------------
def test_a_checked_chain_has_exact_draft_probabilities_and_kv():
    """Root and chain in one forward of the draft model: the same log-probs as a fresh forward over
    context + chain, and the chain rows are the first tree rows."""
    _, draft = similar_draft("llama", 4)
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2)
    context, chain = list(range(10, 22)), [5, 9, 33]
    drafter.cache.prefill(context[:8])
    drafter.joined = True  # it has read 8 tokens of the request
    logp, _ = drafter._root_and_chain(context, chain)
    with torch.no_grad():
        fresh = torch.log_softmax(draft(torch.tensor([context + chain])).logits[0, len(context) - 1 :], dim=-1)
    torch.testing.assert_close(logp, fresh, atol=1e-4, rtol=1e-4)
    assert drafter.forward_rows == [4 + 3]


def test_the_chain_joins_the_pool_with_the_drafters_scores():
    _, draft = similar_draft("llama", 5)
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2, prune=PruneSchedule((), 0.0))
    context = list(range(30, 45))
    drafter.start(context[:-1], None, len(context) + 64)
    tree = drafter.draft(context, 12, chain=[7, 8], objective=Objective(FLAT))
    pool = drafter.pool
    assert [(n.token, n.parent) for n in pool.nodes[:2]] == [(7, -1), (8, 0)]
    with torch.no_grad():
        fresh = torch.log_softmax(draft(torch.tensor([context + [7]])).logits[0, -2:], dim=-1)
    assert pool.nodes[0].score == pytest.approx(fresh[0, 7].exp().item(), rel=1e-4)
    assert pool.nodes[1].score == pytest.approx((fresh[0, 7] + fresh[1, 8]).exp().item(), rel=1e-4)
    root_kids = [pool.nodes[i].token for i in pool.children(-1)]
    assert root_kids.count(7) == 1  # the root's own children leave out the chain's token
    assert set(drafter.fed) >= {0, 1} and drafter.fed[0] == 0 and drafter.fed[1] == 1
    assert len(tree) <= 12


# --- lossless ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cost_aware_graft_is_lossless_with_a_draft_model(kind):
    checked = 0
    for seed in range(3):
        target, draft = similar_draft(kind, seed)
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 12).tolist()
        prompt = prompt + prompt[:8]  # something for prompt lookup to find, so chains are checked
        truth = run(target, GraftProposer(0), prompt, 48)
        drafter = DraftModelDrafter(draft, VOCAB, depth=24, top_k=2, prune=PruneSchedule((), 0.1))
        seen = []
        inner = drafter._root_and_chain
        drafter._root_and_chain = lambda c, chain, _i=inner: (seen.append(len(chain)), _i(c, chain))[1]
        stats = Stats()
        assert run(target, cost_proposer(drafter), prompt, 48, stats) == truth
        checked += len(seen)
    assert checked > 0  # retrieved chains really were checked


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=20)])
def test_a_planned_cost_aware_draft_is_lossless(sampling):
    """The GPU's mode (the depth planned before each draft, one read at its end) changes trees, never text."""
    target, draft = similar_draft("llama", 1)
    prompt = list(range(40, 52)) * 2
    truth = run(target, GraftProposer(0), prompt, 40, sampling=sampling, seed=3)
    drafter = DraftModelDrafter(draft, VOCAB, depth=24, top_k=2, prune=PruneSchedule((), 0.1))
    proposer = cost_proposer(drafter)
    proposer.objective.planned = True
    levels = []
    inner = drafter.draft
    drafter.draft = lambda *a, **k: (levels.append(proposer.objective.levels), inner(*a, **k))[1]
    stats = Stats()
    assert run(target, proposer, prompt, 40, stats, sampling=sampling, seed=3) == truth
    assert stats.draft_forwards > 0 and len(set(levels)) > 1  # the plan moved with what the drafts showed


def test_cost_aware_graft_samples_the_same_text_as_plain_sampling():
    target, draft = similar_draft("llama", 2)
    prompt = list(range(40, 52)) * 2
    sampling = Sampling(temperature=0.8, top_k=20)
    for seed in (1, 2):
        truth = run(target, GraftProposer(0), prompt, 40, sampling=sampling, seed=seed)
        drafter = DraftModelDrafter(draft, VOCAB, depth=24, top_k=2, prune=PruneSchedule((), 0.1))
        assert run(target, cost_proposer(drafter), prompt, 40, sampling=sampling, seed=seed) == truth


def test_cost_aware_graft_is_lossless_with_an_eagle3_head(tmp_path):
    target = target_model()
    head = load_head(str(write_head(tmp_path / "h", target)), target)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    truth = run(target, GraftProposer(0), prompt, 40)
    drafter = Eagle3Drafter(head, target, depth=24, top_k=2, prune=PruneSchedule((), 0.05))
    stats = Stats()
    assert run(target, cost_proposer(drafter, retrievers=[PromptLookup()]), prompt, 40, stats) == truth
    assert stats.draft_forwards > 0


def test_an_unwanted_drafter_is_skipped_when_retrieval_is_faster():
    """A draft that costs a lot and is never right: the measured rates soon stop drafting (but look again)."""
    target = tiny_model("llama", seed=1)
    drafter = DraftModelDrafter(tiny_model("qwen2", seed=9), VOCAB, depth=24, top_k=2, prune=PruneSchedule((), 0.1))
    prompt = list(range(3, 15)) * 3
    truth = run(target, GraftProposer(0), prompt, 60)
    proposer = cost_proposer(drafter)
    assert run(target, proposer, prompt, 60) == truth
    levels = [r["levels"] for r in proposer.trace]
    assert levels.count(0) > 0 and any(levels)


# --- wiring -----------------------------------------------------------------------------------------------------
def test_graft_with_a_drafter_builds_by_cost_unless_fixed(monkeypatch):
    loaded = tiny_loaded(tiny_model(seed=1))
    def fake(kind, env):
        return DraftModelDrafter(tiny_model(seed=2), VOCAB, env.settings.depth, env.settings.draft_top_k, env.prune, env.settings.chain)

    monkeypatch.setattr(methods, "load_drafter", fake)
    cost = methods.build(MethodConfig("graft", draft="d"), loaded)
    assert cost.objective is not None and cost.drafter.depth == cost.objective.max_levels == 24
    assert not cost.drafter.prune.checkpoints and cost.drafter.prune.floor == 0.1  # the floor stays
    fixed = methods.build(MethodConfig("graft", draft="d", tree="fixed"), loaded)
    assert not isinstance(fixed, CostAwareProposer) and fixed.drafter.depth == 8 and fixed.budget == 16
    capped = methods.build(MethodConfig("graft", draft="d", drafting=DraftSettings(depth=5)), loaded)
    assert capped.objective.max_levels == 5
    assert not isinstance(methods.build(MethodConfig("dense", draft="d"), loaded), CostAwareProposer)
    for bad in [MethodConfig("graft", tree="cost"), MethodConfig("dense", draft="d", tree="cost"),
                MethodConfig("graft", draft="d", tree="deep")]:
        with pytest.raises(GraftError):
            methods.build(bad, loaded)


def test_trees_chosen_by_another_devices_curve(monkeypatch):
    """``curve=cuda`` on a CPU: trees are chosen as a GPU's costs would choose them (the GPU projection's runs),
    by the fixed tree and by the cost-aware one alike; an unknown device is refused."""
    loaded = tiny_loaded(tiny_model(seed=1))
    from graft_cli.core.defaults import CPU, CUDA
    monkeypatch.setattr(methods, "load_drafter", lambda kind, env: DraftModelDrafter(
        tiny_model(seed=2), VOCAB, env.settings.depth, env.settings.draft_top_k, env.prune, env.settings.chain))
    retrieval = methods.build(MethodConfig("graft", curve="cuda"), loaded)
    assert retrieval.latency.points == CUDA.latency
    cost = methods.build(MethodConfig("graft", draft="d", curve="cuda"), loaded)
    assert cost.objective.latency.points == CUDA.latency and cost.latency is cost.objective.latency
    assert methods.build(MethodConfig("graft"), loaded).latency.points == CPU.latency
    with pytest.raises(GraftError, match="curve=tpu"):
        methods.build(MethodConfig("graft", curve="tpu"), loaded)
