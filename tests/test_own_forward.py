"""graft's own forward (graft_cli/models) against transformers, the reference: the same logits within fp32
tolerance for a prefill, chunks after a cache, decoding and tree verification, the same hidden states, and the
same greedy tokens through every engine path (trees, the split attention, the fixed-shape path, a generator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.bench.synthetic import save_model_dir, word_tokenizer
from graft_cli.core import ROOT, GraftError, Tree
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.models import attention as split_kernel
from graft_cli.models import own_model
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.target import Target
from tests.test_kv_cache import tokens
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model

TOLERANCE = 1e-4  # fp32 logits of a random tiny model reach about 10: a few ulps of summation order


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    """A tiny random model of each family (transformers') and graft's forward over its saved checkpoint."""
    reference = tiny_model(request.param, seed=3, layers=3, max_position_embeddings=1024)
    folder = save_model_dir(tmp_path_factory.mktemp(request.param) / "tiny", reference, word_tokenizer())
    return reference, own_model(reference.config, folder, torch.float32)


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def test_logits_and_hidden_states_match_transformers_without_a_cache(pair):
    reference, own = pair
    ids = torch.tensor([prompt(40)])
    with torch.inference_mode():
        want, got = reference(ids, output_hidden_states=True), own(ids, output_hidden_states=True)
    torch.testing.assert_close(got.logits, want.logits, atol=TOLERANCE, rtol=0)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    for mine, theirs in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(mine, theirs, atol=TOLERANCE, rtol=0)


def test_chunked_prefill_decode_and_a_tree_match_transformers(pair):
    """The same calls on both models through graft's cache: a prefill in chunks (each after a cache), one decoded
    row, then a tree under its 4D mask with per-node positions; logits and hidden states agree."""
    ids = prompt(70, seed=1)
    targets = [Target(model, chunk=16) for model in pair]
    first = [t.prefill(ids, hidden=True) for t in targets]
    torch.testing.assert_close(first[1].logits, first[0].logits, atol=TOLERANCE, rtol=0)
    for mine, theirs in zip(first[1].hidden, first[0].hidden):
        torch.testing.assert_close(mine, theirs, atol=TOLERANCE, rtol=0)
    step = [t.verify(5, Tree()).logits for t in targets]
    torch.testing.assert_close(step[1], step[0], atol=TOLERANCE, rtol=0)
    tree = Tree()
    tree.add(tree.add(ROOT, 7, "test", 0.5), 9, "test", 0.3)
    tree.add(ROOT, 11, "test", 0.2)
    verified = [t.verify(3, tree, hidden=True) for t in targets]
    torch.testing.assert_close(verified[1].logits, verified[0].logits, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(verified[1].hidden[2], verified[0].hidden[2], atol=TOLERANCE, rtol=0)


def test_trees_decode_the_tokens_of_plain_decoding(pair):
    reference, own = pair
    ids = prompt(30, seed=2)
    truth = tokens(Target(reference), GraftProposer(0), ids, 50)
    assert tokens(Target(own), GraftProposer(0), ids, 50) == truth
    for seed in range(2):
        assert tokens(Target(own, chunk=8), OracleTreeProposer(truth, len(ids), seed, "mixed"), ids, 50) == truth


def test_the_split_attention_and_the_fixed_shape_path_decode_the_same_tokens(pair, monkeypatch):
    reference, own = pair
    ids = prompt(60, seed=3)
    truth = tokens(Target(reference), GraftProposer(0), ids, 40)
    monkeypatch.setattr(split_kernel, "SPLIT_FROM", 8)  # every chunk past the first and every tree splits
    assert tokens(Target(own, chunk=16), OracleTreeProposer(truth, len(ids), 1, "mixed"), ids, 40) == truth
    monkeypatch.undo()
    assert tokens(FixedShapeTarget(own), OracleTreeProposer(truth, len(ids), 2, "random"), ids, 40) == truth


def test_load_model_chooses_the_forward_and_refuses_what_it_cannot_run(tmp_path):
    folder = save_model_dir(tmp_path / "tiny", tiny_model("qwen2", seed=5), word_tokenizer())
    own, reference = (load_model(str(folder), "cpu", forward=f).model for f in ("own", "transformers"))
    assert type(own).__module__ == "graft_cli.models.decoder"
    assert type(reference).__module__.startswith("transformers")
    ids = prompt(20, seed=4)  # packed for the CPU (the stacked weights' plain copies released): the same tokens
    assert tokens(Target(own), GraftProposer(0), ids, 20) == tokens(Target(reference), GraftProposer(0), ids, 20)
    with pytest.raises(GraftError, match="--forward"):
        load_model(str(folder), "cpu", forward="fast")
    sliding = save_model_dir(tmp_path / "sliding", tiny_model("qwen2", seed=5, use_sliding_window=True,
                                                             sliding_window=64), word_tokenizer())
    with pytest.raises(GraftError, match="--forward own"):
        load_model(str(sliding), "cpu", forward="own")


@pytest.mark.real_model
def test_the_default_model_decodes_transformers_tokens_with_ar_and_graft():
    """SmolLM2 through graft's forward: ``ar`` and ``graft`` give the tokens transformers' ``generate`` gives."""
    from graft_cli.method import builder as methods
    from graft_cli.runtime.engine import decode
    from graft_cli.runtime.loading import encode, stop_ids
    from graft_cli.runtime.sampling import Sampling

    reference = load_model("smollm2-135m-instruct", "cpu", forward="transformers")
    own = load_model("smollm2-135m-instruct", "cpu", forward="own")
    ids = encode(own.tokenizer, "Write a Python function that reverses a string.")
    with torch.inference_mode():
        want = reference.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):]
    for method in ("ar", "graft"):
        proposer = methods.build(methods.MethodConfig(method), own)
        steps = decode(Target(own.model), proposer, ids, Sampling(), 32, stop_ids(own), None)
        assert [t for step in steps for t in step] == want.tolist(), method
