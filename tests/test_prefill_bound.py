"""benchmarks/prefill.py's fp32 ceiling of a prefill: the FLOPs it counts and the rate it divides them by."""

from types import SimpleNamespace

import torch

from benchmarks.prefill import gemm_ceiling, prefill_flops


def test_a_prefill_counts_every_projection_and_the_causal_pairs():
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
                             num_hidden_layers=3)
    linear, attention = prefill_flops(config, 5)
    per_layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 12  # q, k, v, o (head_dim 4) and the MLP's three
    assert linear == 2 * per_layer * 3 * 5
    assert attention == 2 * 2 * 4 * 2 * 3 * 15  # QK and PV, head_dim 4, 2 heads, 3 layers, 15 causal pairs


def test_the_ceiling_is_a_rate_of_the_models_own_linears():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    rate = gemm_ceiling(model, rows=8, repeats=2)
    assert rate > 1e6  # FLOP/s: at least a megaflop on any machine
