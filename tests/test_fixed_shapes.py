"""The fixed-shape path (graft_cli/runtime/fixed_target.py) run eagerly on a CPU: every method gives the eager path's
tokens, greedy and sampled; device acceptance, choices and masks equal the host's on random trees; padded rows
leave the real rows' logits and the compacted cache as they were; the static buffers stay put; one read a step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import graft_cli
from graft_cli.method import builder as methods
from graft_cli.bench.runners import shared_models
from graft_cli.core import GraftError, Needs, ROOT, Tree
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.device_accept import NoiseRing, accepted_rows, choose
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_shapes import BUCKETS, StaticInputs, bucket, key_rows, tree_mask
from graft_cli.runtime.fixed_target import FixedShapeTarget, make_target
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.sampling import Noise, Sampling, sample
from graft_cli.runtime.target import Target
from graft_cli.runtime.verify import accept
from graft_cli.bench.synthetic import OracleTreeProposer, method_configs, random_tree, synthetic_models, text_store
from plugins.adjacency import AdjacencyRetriever
from plugins.prompt_lookup import PromptLookup
from tests.bench_fixtures import run_cli
from tests.test_device import Discipline, decode_reading
from tests.tiny import VOCAB, tiny_model

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=8, top_p=0.95)}
CPU = torch.device("cpu")


def tokens(target: Target, proposer, prompt: list[int], sampling: Sampling, n: int = 32, seed: int = 7) -> list[int]:
    return [t for step in decode(target, proposer, prompt, sampling, n, set(), seed) for t in step]


def prompts(count: int = 2) -> list[list[int]]:
    """Prompts with a repeated stretch (a b a), so that prompt lookup has something to find."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        a, b = rng.integers(0, VOCAB, 8).tolist(), rng.integers(0, VOCAB, 8).tolist()
        out.append(a + b + a)
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A saved tiny target (drafting for itself), its random EAGLE-3 head, a REST store over its own text, and
    every method's configuration on the CPU's latency curve (no profiling)."""
    root = tmp_path_factory.mktemp("fixed")
    target_dir, head = synthetic_models(root, layers=4)
    loaded = load_model(str(target_dir), "cpu", "float32")
    texts = [" ".join(f"t{t}" for t in tokens(Target(loaded.model), GraftProposer(0), p, Sampling(), 48))
             for p in prompts()]
    store = text_store(root, target_dir, texts)
    configs = {name: replace(config, curve="cpu")
               for name, config in method_configs(target_dir, head, store, depth=4).items()}
    return loaded, configs


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_every_method_gives_the_eager_paths_tokens(synthetic, sampling):
    loaded, configs = synthetic
    with shared_models(loaded):
        for name, config in configs.items():
            for prompt in prompts():
                eager = tokens(Target(loaded.model), methods.build(config, loaded), prompt, sampling)
                target = FixedShapeTarget(loaded.model)
                proposer = methods.build(config, loaded, target)  # draft levels at fixed shapes too
                assert tokens(target, proposer, prompt, sampling) == eager, name
                drafter = getattr(proposer, "drafter", None)
                assert drafter is None or drafter.fixed is not None


def matching_tree(rng: np.random.Generator, best: list[int], size: int) -> Tree:
    """A random tree whose nodes often carry the token chosen at their parent's row (``best[row]``), so that
    paths of every length are accepted."""
    tree = Tree()
    while len(tree) < size:
        parent = ROOT if not len(tree) or rng.random() < 0.25 else int(rng.integers(len(tree)))
        token = best[parent + 1] if rng.random() < 0.6 else int(rng.integers(VOCAB))
        tree.add(parent, token, "test", 0.5)
    return tree


def padded(inputs: StaticInputs, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` of the real rows, then random rows for the padding."""
    rows = torch.randn((inputs.size, logits.shape[1]))
    rows[: logits.shape[0]] = logits
    return rows


def test_device_acceptance_equals_verify_accept_on_random_trees():
    rng, greedy = np.random.default_rng(1), Sampling()
    for trial in range(300):
        size = int(rng.integers(0, 140))
        logits = torch.randn((size + 1, VOCAB)) * 3
        tree = matching_tree(rng, logits.argmax(-1).tolist(), size)
        logits = logits[: len(tree) + 1]
        inputs = StaticInputs(bucket(len(tree) + 1), CPU)
        inputs.write(int(rng.integers(VOCAB)), tree, tree.depths(), int(rng.integers(0, 50)), 0, 1)
        packed = accepted_rows(choose(padded(inputs, logits), greedy, None), inputs).tolist()
        want = accept(tree, logits, greedy)
        count = packed[0]
        assert (packed[1], [r - 1 for r in packed[3 : 2 + count]]) == (want.bonus, want.nodes), trial
        assert packed[2 + count :] == list(range(count, inputs.size))  # padding points at its own row


def test_device_choices_are_the_hosts_samples_from_the_same_noise():
    sampling = SAMPLINGS["sampled"]
    rng = np.random.default_rng(2)
    host, ring = Noise(5, "cpu"), NoiseRing(Noise(5, "cpu"), VOCAB, 9)  # a small ring: it must grow and wrap
    position = 0
    for _ in range(40):
        tree = random_tree(int(rng.integers(0, 30)), VOCAB, rng)
        depths = tree.depths()
        logits = torch.randn((len(tree) + 1, VOCAB)) * 2
        want = sample(logits, sampling, host, position, depths)
        inputs = StaticInputs(bucket(len(tree) + 1), CPU)
        ring.fill(position, position + int(depths.max()) + 1)
        inputs.write(0, tree, depths, 10, position, ring.size)
        got = choose(padded(inputs, logits), sampling, ring.rows.index_select(0, inputs.slots))
        assert got[: len(tree) + 1].tolist() == want.tolist()
        position += int(rng.integers(1, int(depths.max()) + 2))


def test_the_device_mask_is_the_ancestor_mask_past_the_context():
    rng = np.random.default_rng(3)
    for _ in range(60):
        tree = random_tree(int(rng.integers(0, 70)), VOCAB, rng)
        n, size = len(tree) + 1, bucket(len(tree) + 1)
        past = int(rng.integers(0, 40))
        inputs = StaticInputs(size, CPU)
        inputs.write(1, tree, tree.depths(), past, 0, 1)
        allowed = (tree_mask(inputs, past + size + int(rng.integers(0, 30)), torch.float32)[0, 0] == 0).numpy()
        assert allowed[:, :past].all()  # every row sees the context
        assert (allowed[:n, past : past + n] == tree.ancestor_mask()).all()
        assert (allowed[n:, past:] == np.eye(size - n, allowed.shape[1] - past, n)).all()  # padding: itself
        assert not allowed[:n, past + n :].any()


@pytest.mark.parametrize("past, capacity", [(30, 400), (1000, 2600)])  # keys: the whole cache; 2048 of it
def test_padded_verification_gives_the_real_rows_logits_and_cache(past, capacity):
    model, rng = tiny_model("qwen2", seed=4, max_position_embeddings=4096), np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB, past).tolist()
    eager, fixed = Target(model), FixedShapeTarget(model)
    for target in (eager, fixed):
        target.prefill(prompt, capacity=capacity)
    rule = fixed.rule(Sampling(), None, Needs(), past)
    for _ in range(1, 12):
        tree, root = random_tree(int(rng.integers(0, 100)), VOCAB, rng), int(rng.integers(VOCAB))
        want = eager.step([*prompt, root], tree, rule)
        got = fixed.step([*prompt, root], tree, rule)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        assert (got.accepted, got.kept) == (want.accepted, want.kept) and fixed.length == eager.length
        length = eager.length
        torch.testing.assert_close(fixed.cache.block[..., :length, :], eager.cache.block[..., :length, :])


def test_buckets():
    assert [bucket(n) for n in (1, 2, 16, 17, 128, 129, 200)] == [1, 16, 16, 32, 128, 192, 256]
    assert BUCKETS[0] == 1  # plain decoding is a bucket of its own
    assert [key_rows(end, 5000) for end in (1, 1024, 1025, 2100, 4097)] == [1024, 1024, 2048, 4096, 5000]
    assert key_rows(700, 800) == 800


def test_one_read_a_step_and_buffers_that_stay_put():
    """The target's share of a step reads the device once (the accepted result); its input blocks and the KV
    block are the same memory from the first step to the last."""
    model, prompt = tiny_model(seed=5), prompts(1)[0]
    truth = tokens(Target(model), GraftProposer(0), prompt, Sampling(), 60)
    target = FixedShapeTarget(model)
    mode, reads, places = Discipline(scope=("graft_cli/runtime/",), strict=False), [], []
    steps = decode(target, OracleTreeProposer(truth, len(prompt), 3), prompt, Sampling(), 60, set(), 0)
    got = list(next(steps))
    with mode:
        for new in steps:
            got += new
            reads.append(mode.reads)
            places.append((target.cache.block.data_ptr(), *(inputs.block.data_ptr()
                                                              for _, inputs in sorted(target.inputs.items()))))
    assert got == truth
    assert max(np.diff([0, *reads])) <= 1
    assert all(place[: len(later)] == later[: len(place)] for place, later in zip(places, places[1:]))


def test_recycling_learns_the_same_table_from_the_steps_one_read():
    """Token Recycling's top-k comes with the step's read on the path: the same table and tokens as the eager
    path's device top-k; the prefill reads its token and its row's top-k together, and every step (retrievers
    and all, the first included) reads the device once."""
    model, prompt = tiny_model(seed=7), prompts(1)[0]
    runs = {}
    for target in (Target(model), FixedShapeTarget(model)):
        retriever = AdjacencyRetriever(VOCAB)
        proposer = GraftProposer(12, [PromptLookup(), retriever])
        got, reads = decode_reading(target, proposer, prompt, Sampling(), 50, seed=0)
        runs[type(target)] = (got, retriever.tokens.clone(), retriever.probs.clone(), reads)
        assert proposer.needs.successors == retriever.k
    (eager, table, probs, _), (fixed, fixed_table, fixed_probs, reads) = runs[Target], runs[FixedShapeTarget]
    assert fixed == eager and torch.equal(fixed_table, table)
    torch.testing.assert_close(fixed_probs, probs)
    assert reads == [1] * len(reads)  # the prefill's, then each step's


def test_the_new_modules_keep_device_discipline():
    """No hidden synchronisation and no tensor without its device in the fixed-shape modules (strict mode)."""
    model, prompt = tiny_model(seed=6), prompts(1)[0]
    truth = tokens(Target(model), GraftProposer(0), prompt, Sampling(), 40)
    scope = ("runtime/fixed_shapes.py", "runtime/device_accept.py", "runtime/fixed_target.py", "runtime/graphs.py")
    for sampling in SAMPLINGS.values():
        with Discipline(scope=scope):
            tokens(FixedShapeTarget(model), OracleTreeProposer(truth, len(prompt), 4), prompt, sampling, 40)


def test_the_switch():
    model = tiny_model()
    assert type(make_target(model, "auto")) is Target  # a CPU pays for padding: off unless asked
    assert type(make_target(model, "on")) is FixedShapeTarget and type(make_target(model, "off")) is Target
    with pytest.raises(GraftError):
        make_target(model, "maybe")


def test_the_switch_in_the_api_and_the_command_line(synthetic, capsys):
    loaded, configs = synthetic
    folder = configs["graft"].draft
    prompt = " ".join(f"t{t}" for t in prompts(1)[0])
    texts = {}
    for switch in ("on", "off"):
        with graft_cli.load(folder, method="graft", device="cpu", graphs=switch) as generator:
            assert isinstance(generator.target, FixedShapeTarget) == (switch == "on")
            texts[switch] = generator.generate(prompt, max_new_tokens=20, raw=True, temperature=0.8, seed=3).text
    assert texts["on"] == texts["off"]
    code, out, _ = run_cli(["generate", prompt, "--model", folder, "--raw", "-n", "20", "--device", "cpu", "-t",
                            "0.8", "--seed", "3", "--graphs", "on"], capsys)
    assert code == 0 and out.removesuffix("\n") == texts["on"]
    for ahead in (None, True):  # a draft model drafts after the read unless --draft-ahead
        with graft_cli.load(folder, draft=folder, device="cpu", graphs="on", draft_ahead=ahead) as generator:
            assert generator.proposer.drafter.before_read == bool(ahead)
    code, out, _ = run_cli(["generate", prompt, "--model", folder, "--draft", folder, "--raw", "-n", "20", "--device",
                            "cpu", "-t", "0.8", "--seed", "3", "--graphs", "on", "--draft-ahead"], capsys)
    assert code == 0 and out.removesuffix("\n") == texts["on"]
    code, _, err = run_cli(["generate", prompt, "--model", folder, "--graphs", "maybe"], capsys)
    assert code == 2 and "--graphs must be one of auto, on, off" in err
    with pytest.raises(GraftError, match="--graphs"):
        graft_cli.load(folder, graphs="sometimes")
