"""The CPU linear kernels compute the same product as ``F.linear``, and decoding through them stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from graft_cli.core.cpu_units import CpuUnits
from graft_cli.runtime import cpu_linear
from graft_cli.runtime.cpu_linear import CpuLinear, use_cpu_linears
from graft_cli.drafting.proposer import GraftProposer
from tests.test_engine import OracleTreeProposer, run
from tests.tiny import VOCAB, tiny_model


@pytest.mark.parametrize("shape", [(2048, 1024), (1024, 2048), (96, 64)])  # wide and large, narrowing, small
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pack", [True, False])
def test_every_row_count_gives_the_linear_product(shape, bias, pack):
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=bias)
    weight = layer.weight.detach().clone()
    use_cpu_linears(layer, pack=pack)
    assert type(layer) is CpuLinear and (layer.packed is not None) == pack
    assert torch.equal(layer.weight, weight)  # the plain weight stays: an EAGLE-3 trainer or --draft-vocab reads it
    for rows in (1, 2, 3, 4, 5, 6, 9):
        x = torch.randn(1, rows, shape[1])
        got = layer(x)
        assert got.shape == (1, rows, shape[0]) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight, layer.bias), rtol=1e-4, atol=1e-4)


def test_a_model_is_packed_only_when_the_copy_fits_in_memory(monkeypatch):
    assert cpu_linear.available_memory() > 0  # Linux: /proc/meminfo
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 0)
    model = tiny_model()
    use_cpu_linears(model)
    assert all(m.packed is None for m in model.modules() if isinstance(m, CpuLinear))
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 1 << 40)
    model = tiny_model()
    use_cpu_linears(model)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, CpuLinear))


def test_tied_weights_stay_tied_and_other_dtypes_are_left_alone():
    model = tiny_model()
    model.lm_head.weight = model.model.embed_tokens.weight
    use_cpu_linears(model)
    assert type(model.lm_head) is CpuLinear and model.lm_head.weight is model.model.embed_tokens.weight
    half = torch.nn.Linear(4, 4).to(torch.float16)
    use_cpu_linears(half)
    assert type(half) is torch.nn.Linear


@pytest.mark.parametrize("units", [True, False])
def test_bf16_layers_are_packed_only_where_the_cpu_multiplies_bf16(monkeypatch, units):
    """Packed bf16 takes half packed fp32's time where the units exist; elsewhere bf16 is emulated either way and
    stays plain."""
    monkeypatch.setattr(cpu_linear, "cpu_units", lambda: CpuUnits("test", avx512_bf16=units))
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    use_cpu_linears(layer, pack=True)
    assert (type(layer) is CpuLinear) == units
    x = torch.randn(1, 9, 64, dtype=torch.bfloat16)
    full = layer(x)
    assert full.dtype == torch.bfloat16
    torch.testing.assert_close(full, F.linear(x, weight, layer.bias), rtol=2e-2, atol=2e-2)
    if units:  # a row's bits do not depend on the rows beside it: a bf16 tree's linears match a one-row step
        for row in range(9):
            assert torch.equal(layer(x[:, row : row + 1]), full[:, row : row + 1])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_random_trees_stay_lossless_through_the_cpu_kernels(kind):
    for seed in range(3):
        model = tiny_model(kind, seed=seed)
        use_cpu_linears(model)
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 12).tolist()
        truth = run(model, GraftProposer(0), prompt, 60)
        assert run(model, OracleTreeProposer(truth, len(prompt), seed, "mixed"), prompt, 60) == truth


def test_graft_cpu_pack_overrides_the_memory_rule(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 1 << 40)
    monkeypatch.setenv("GRAFT_CPU_PACK", "0")
    model = tiny_model()
    use_cpu_linears(model)
    assert all(m.packed is None and m.weight.numel() > 0 for m in model.modules() if isinstance(m, CpuLinear))
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 0)
    monkeypatch.setenv("GRAFT_CPU_PACK", "1")
    model = tiny_model()
    use_cpu_linears(model)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, CpuLinear))
