"""benchmarks/forward_parts.py: the tree it verifies and the multiply-adds its floor counts."""

from types import SimpleNamespace

import torch

from benchmarks.forward_parts import multiply_adds, stream_rate, tree_mask
from benchmarks.prefill import gemm_ceiling


def test_a_tree_row_sees_the_cache_and_its_ancestors_at_their_depths():
    given = tree_mask(context=3, rows=5)  # parents: -1, 0, 0, 1, 1
    seen = given["attention_mask"][0, 0]
    assert seen[:, :3].all()
    assert seen[3, 3:].tolist() == [True, True, False, True, False]
    assert seen[4, 3:].tolist() == [True, True, False, False, True]
    assert given["position_ids"].tolist() == [[3, 4, 4, 5, 5]]
    assert given["visible"] == 3


def test_the_floor_counts_the_layers_the_logits_and_each_rows_keys():
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
                             num_hidden_layers=3, vocab_size=10)
    per_row = (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 12) * 3  # q, k, v, o (head_dim 4) and the MLP, 3 layers
    assert multiply_adds(config, rows=2, keys=0, logits=1) == 2 * per_row + 8 * 10
    assert multiply_adds(config, rows=1, keys=5, logits=0) == per_row + 2 * 5 * 2 * 4 * 3  # QK and PV


def test_the_bars_are_rates_measured_here():
    assert stream_rate(megabytes=8) > 1e8  # bytes a second
    model = torch.nn.Sequential(torch.nn.Linear(16, 32)).to(torch.bfloat16)
    assert gemm_ceiling(model, rows=8, repeats=2, dtype=torch.bfloat16) > 1e6
