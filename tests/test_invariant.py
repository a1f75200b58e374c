"""Row-invariant attention (graft_cli/models/invariant.py), through graft's C++ kernel and through torch's path: a
tree's or a chunk's row gets, bit for bit, what a one-row step at its position gets, close to fp32 attention;
through the model, bf16 trees decode plain bf16 decoding's tokens exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.bench.synthetic import save_model_dir, word_tokenizer
from graft_cli.core.cpu_units import CpuUnits
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.models import own_model
from graft_cli.models.config import plain_config
from graft_cli.models import invariant
from graft_cli.models.invariant import BLOCK, FEW_ROWS, invariant_rows, layout_for
from graft_cli.runtime import cpu_linear
from graft_cli.runtime.cpu_linear import use_cpu_linears
from graft_cli.runtime.target import Target
from tests.test_kv_cache import tokens
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5, -1, 9]  # a tree of two roots; node i's parent (-1: the step's root)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each test once through graft's C++ kernel (skipped where none is built: no AVX512-BF16 or no compiler) and
    once through torch's operations."""
    if request.param == "torch":
        monkeypatch.setattr(invariant, "attention_kernel", lambda: None)
    elif invariant.attention_kernel() is None:
        pytest.skip("no attention kernel on this machine")
    return request.param


def layout(mask, rows: int, visible, past: int):
    return layout_for(torch.zeros(1, rows, 4, dtype=torch.bfloat16), mask, visible, past)


def ancestry(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize("cached", [5, 64, 150, 1000, 4000])  # within a block, on its edge, past a few, long
@pytest.mark.parametrize("given", ["visible", "mask only", "bool"])
def test_a_tree_row_is_the_one_row_step_at_its_position(cached, given, path):
    gen = torch.Generator().manual_seed(cached)
    rows, keys = len(PARENTS), cached + len(PARENTS)
    query, key, value = (torch.randn(1, h, n, 64, generator=gen).bfloat16()
                         for h, n in ((6, rows), (2, keys), (2, keys)))
    seen = torch.zeros(rows, keys, dtype=torch.bool)
    seen[:, :cached] = True
    for row in range(rows):
        seen[row, [cached + a for a in ancestry(row)]] = True
    mask = seen if given == "bool" else torch.zeros(rows, keys).masked_fill_(~seen, torch.finfo(torch.float32).min)
    tree = invariant_rows(query, key, value, layout(mask[None, None], rows, cached if given == "visible" else None,
                                                    cached), 0.125)
    want = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                            attn_mask=seen[None, None], scale=0.125, enable_gqa=True)
    torch.testing.assert_close(tree.float(), want, atol=3e-2, rtol=0)
    for row in range(rows):
        columns = list(range(cached)) + [cached + a for a in ancestry(row)]
        alone = invariant_rows(query[:, :, row : row + 1], key[:, :, columns], value[:, :, columns],
                               layout(None, 1, None, len(columns) - 1), 0.125)
        assert torch.equal(alone, tree[:, :, row : row + 1])


@pytest.mark.parametrize("rows", [12, 150])  # a step's few rows; a prompt's chunk, whose blocks add one by one
def test_a_causal_chunks_rows_are_one_row_steps(rows, path):
    gen = torch.Generator().manual_seed(rows)
    cached = 70
    query, key, value = (torch.randn(1, h, n, 32, generator=gen).bfloat16()
                         for h, n in ((4, rows), (2, cached + rows), (2, cached + rows)))
    chunk = invariant_rows(query, key, value, layout(None, rows, None, cached), 0.25)
    for row in range(rows):
        end = cached + row + 1
        alone = invariant_rows(query[:, :, row : row + 1], key[:, :, :end], value[:, :, :end],
                               layout(None, 1, None, end - 1), 0.25)
        assert torch.equal(alone, chunk[:, :, row : row + 1])


def test_a_chunks_rows_do_not_depend_on_the_pieces_it_attends_in(monkeypatch, path):
    """Past 4,096 keys a chunk attends in pieces of fewer rows (``PIECE_SPAN``): the same bits."""
    from graft_cli.models import invariant

    gen = torch.Generator().manual_seed(7)
    rows, keys = 100, 300
    query, key, value = (torch.randn(1, h, n, 32, generator=gen).bfloat16()
                         for h, n in ((4, rows), (2, keys), (2, keys)))
    whole = invariant_rows(query, key, value, layout(None, rows, None, keys - rows), 0.25)
    monkeypatch.setattr(invariant, "PIECE_SPAN", 8 * keys)  # pieces of 8 rows
    assert torch.equal(invariant_rows(query, key, value, layout(None, rows, None, keys - rows), 0.25), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_softmax_over_whole_blocks_is_the_fp32_one_rounded_whatever_trails_it(dtype):
    """What the attention relies on of torch: over whole blocks of keys, the softmax in bf16 (or fp16) gives the
    fp32 softmax's bits rounded, and trailing blocks at -inf change no bit."""
    gen = torch.Generator().manual_seed(11)
    for keys in (BLOCK, 3 * BLOCK, 63 * BLOCK):
        scores = (4 * torch.randn(12, keys, generator=gen)).to(dtype)
        scores[:, keys - 7 :] = float("-inf")  # a row's own padding
        alone = torch.softmax(scores, dim=-1)
        assert torch.equal(alone, torch.softmax(scores.float(), dim=-1).to(dtype))
        trailed = torch.cat([scores, torch.full((12, 2 * BLOCK), float("-inf"), dtype=dtype)], dim=-1)
        assert torch.equal(torch.softmax(trailed, dim=-1)[:, :keys], alone)


def test_it_serves_a_cpus_low_precision_steps_prompts_and_few_rowed_trees():
    assert layout_for(torch.zeros(1, 3, 4), None, None, 10) is None  # fp32: SDPA, whose kernels are fast there
    assert layout_for(torch.zeros(1, 500, 4, dtype=torch.bfloat16), None, None, 0).shared == 0  # a prompt's chunk
    tree = torch.ones(1, 1, FEW_ROWS + 1, FEW_ROWS + 11, dtype=torch.bool)
    assert layout_for(torch.zeros(1, FEW_ROWS + 1, 4, dtype=torch.bfloat16), tree, 10, 10) is None  # a big tree
    assert layout_for(torch.zeros(2, 3, 4, dtype=torch.bfloat16), None, None, 10) is None  # a batch
    assert layout_for(torch.zeros(1, 3, 4, dtype=torch.bfloat16), None, None, 10).shared == 10


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_trees_decode_exactly_the_tokens_of_plain_bf16_decoding(kind, tmp_path, monkeypatch, path):
    """The linears packed as graft loads a bf16 model where the CPU has bf16 units (their rows are invariant too:
    tests/test_prompt_precision.py); the prompt split otherwise for each run, which changes no bit either. Heads of
    64 (two, sharing one key head), a size the kernel serves."""
    monkeypatch.setattr(cpu_linear, "cpu_units", lambda: CpuUnits("test", avx512_bf16=True))
    reference = tiny_model(kind, seed=4, layers=3, max_position_embeddings=1024, hidden_size=128,
                           num_attention_heads=2, num_key_value_heads=1)
    folder = save_model_dir(tmp_path / kind, reference, word_tokenizer())
    model = own_model(plain_config(folder), folder, torch.bfloat16)  # as graft loads it: no transformers config
    use_cpu_linears(model, pack=True)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 90).tolist()
    truth = tokens(Target(model, chunk=32), GraftProposer(0), prompt, 60)
    for seed in range(3):
        assert tokens(Target(model, chunk=17 + seed), OracleTreeProposer(truth, len(prompt), seed, "mixed"), prompt,
                      60) == truth


@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (128, 12, 2), (64, 14, 2)])  # SmolLM2, the Qwen pair
def test_the_kernel_is_fp32_attention_rounded_once(dim, heads, kv_heads):
    """The kernel keeps scores, softmax and sums in fp32: against fp32 attention it differs by about a bf16 rounding,
    and it serves the head sizes and groupings of the catalog's models."""
    if invariant.attention_kernel() is None:
        pytest.skip("no attention kernel on this machine")
    gen = torch.Generator().manual_seed(dim + heads)
    rows, cached = 20, 300
    query, key, value = (torch.randn(1, h, n, dim, generator=gen).bfloat16()
                         for h, n in ((heads, rows), (kv_heads, cached + rows), (kv_heads, cached + rows)))
    got = invariant.native_rows(query, key, value, layout(None, rows, None, cached), dim**-0.5)
    mask = torch.ones(rows, cached + rows, dtype=torch.bool).tril(cached)
    want = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                            attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=8e-3)


def test_the_kernel_declines_what_it_has_no_code_for():
    if invariant.attention_kernel() is None:
        pytest.skip("no attention kernel on this machine")
    query, key = torch.zeros(1, 2, 3, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 10, 32, dtype=torch.bfloat16)
    assert invariant.native_rows(query, key, key, layout(None, 3, None, 7), 0.1) is None  # heads of 32
    assert invariant.native_rows(query.float(), key.float(), key.float(), layout(None, 3, None, 7), 0.1) is None


def test_the_kernel_reads_keys_in_any_layout_alike():
    """A forward without a cache hands over its keys as a view of the projections, not the cache's layout."""
    if invariant.attention_kernel() is None:
        pytest.skip("no attention kernel on this machine")
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 6, 9, 64, generator=gen).bfloat16()
    packed = torch.randn(1, 9, 4, 64, generator=gen).bfloat16()  # [batch, rows, kv heads * 2, dim]
    key, value = packed[:, :, :2].transpose(1, 2), packed[:, :, 2:].transpose(1, 2)
    got = invariant.native_rows(query, key, value, layout(None, 9, None, 0), 0.125)
    assert torch.equal(got, invariant.native_rows(query, key.contiguous(), value.contiguous(),
                                                  layout(None, 9, None, 0), 0.125))
