"""``--dtype q4``: a GGUF's 4-, 5- and 8-bit weights kept as stored. Their blocks read bit for bit as gguf reads
them, a tiny quantized Llama GGUF converted with them kept and run through torch's 4-bit kernel (5 and 8 bits as
two planes), rows that do not depend on the rows beside them, plain decoding and graft giving the same tokens, and
the refusals in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.catalog import q4, resolve
from graft_cli.catalog.home import read_manifest
from graft_cli.core import GraftError
from graft_cli.core.threads import serial
from graft_cli.models.four_bit import PARALLEL_PACKED, FourBitLinear, four_bit_linear, precision
from graft_cli.runtime.loading import load_model
from tests.catalog_fixtures import home, kind_of, random_q4_k, tiny_gguf  # noqa: F401 - home: the fixture


@pytest.mark.parametrize("kind", q4.TYPES)
def test_blocks_read_as_gguf_dequantises_them(kind):
    import gguf

    rng = np.random.default_rng(1)
    rows, columns = 6, 512
    if kind == "Q4_K":
        blocks = random_q4_k(rng, (rows, columns))
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32), kind_of(kind))
    values, scale, offset = q4.unpack(kind, blocks, columns)
    assert values.dtype == np.uint8 and scale.shape == (rows, columns // q4.GROUP)
    assert values.max() == {"Q5_0": 31, "Q5_1": 31, "Q8_0": 255}.get(kind, 15)
    expected = gguf.quants.dequantize(blocks, kind_of(kind))
    assert np.array_equal(q4.dequantised(values, scale, offset), expected)
    if kind in q4.WIDE:  # two 4-bit planes that add up to the same weights
        high_low = q4.dequantised(*q4.planes(values, scale, offset))
        assert np.array_equal(high_low[:, :columns] + high_low[:, columns:], expected)


@pytest.mark.parametrize("kind", q4.TYPES)
def test_the_kernel_multiplies_each_type_as_bf16_would(kind):
    """Through the kernel (5 and 8 bits as two planes), a product within the rounding of its bf16 output of the
    float32 product with the GGUF's own weights: the zero points the planes share stay exact."""
    import gguf

    rng = np.random.default_rng(3)
    rows, columns = 64, 512
    if kind == "Q4_K":
        blocks = random_q4_k(rng, (rows, columns))
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32) / 20, kind_of(kind))
    values, scale, offset = q4.unpack(kind, blocks, columns)
    weight = torch.from_numpy(q4.dequantised(values, scale, offset))
    if kind in q4.WIDE:
        values, scale, offset = q4.planes(values, scale, offset)
    packed = np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4))
    linear = four_bit_linear([tuple(map(torch.from_numpy, (packed, scale, offset)))], None, columns)
    assert linear.planes == (2 if kind in q4.WIDE else 1)
    x = torch.randn(8, columns).to(torch.bfloat16)
    want = x.float() @ weight.t()
    assert (linear(x).float() - want).abs().max() < 2 ** -7 * want.abs().max()


def test_names_of_linear_weights():
    assert q4.hf_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert q4.hf_name("output.weight") == "lm_head.weight"
    assert q4.hf_name("token_embd.weight") is None and q4.hf_name("blk.0.attn_norm.weight") is None


@pytest.fixture
def four_bit_model(home, tmp_path):
    """A tiny Llama GGUF whose linears are Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0, its output projection Q5_1 (but of
    261 rows, which the kernel cannot lay out), converted."""
    path = tmp_path / "tiny-q4.gguf"
    tiny_gguf(path, quantized=True)
    return resolve.resolve_model(str(path))


def test_conversion_keeps_the_four_bit_weights(four_bit_model):
    manifest = read_manifest(four_bit_model)
    assert manifest["q4_weights"] == 7  # every linear but the output projection
    assert q4.FILE in manifest["weights"]  # checksummed as the checkpoint is
    assert next(r for r in resolve.list_models() if r["path"] == str(four_bit_model))["q4_weights"] == 7
    # vLLM (and other loaders) read every *.safetensors of a model directory as the model's own weights
    assert [p.name for p in four_bit_model.glob("*.safetensors")] == ["model.safetensors"]
    loaded = load_model(str(four_bit_model), "cpu", "q4")
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj.planes == 1  # Q4_0 and Q4_1 parts, stacked
    assert layer.mlp.gate_up_proj.planes == 2  # Q4_1 widened to stack with Q5_0
    assert layer.self_attn.o_proj.planes == 2 and layer.mlp.down_proj.planes == 1  # Q8_0, Q4_K
    assert not isinstance(loaded.model.lm_head, FourBitLinear)
    assert precision(loaded.model) == "q4"
    reference = load_model(str(four_bit_model), "cpu", "bfloat16", forward="own")
    ids = torch.tensor([[5, 9, 33, 120, 7, 250]])
    with torch.no_grad():
        got, want = loaded.model(ids).logits.float(), reference.model(ids).logits.float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # the same weights, its scales rounded to bf16


@pytest.mark.parametrize("planes", (1, 2))
def test_rows_do_not_depend_on_the_rows_beside_them(planes):
    rng = np.random.default_rng(2)
    out, columns = 96, 320
    parts = (torch.from_numpy(rng.integers(0, 256, (out, planes * columns // 2), dtype=np.uint8)),
             torch.from_numpy(rng.uniform(1e-3, 1e-2, (out, planes * columns // 32)).astype(np.float32)),
             torch.from_numpy(rng.uniform(-0.05, 0.0, (out, planes * columns // 32)).astype(np.float32)))
    linear = four_bit_linear([parts], torch.randn(out), columns)
    x = torch.randn(300, columns).to(torch.bfloat16)
    whole = linear(x)
    for rows in (1, 2, 5, 17, 64, 65, 128, 299):
        assert torch.equal(linear(x[:rows]), whole[:rows]), rows
    assert torch.equal(linear(x[7:8]), whole[7:8])


@pytest.mark.parametrize("out", [4096, 576])  # 1.1 MiB packed: fanned out even for one row; 0.16 MiB: not
def test_a_weight_gives_one_threads_bits_on_two_crowded_or_free(out):
    """Its kernel is bound by arithmetic, so a one-token step runs a large weight on every thread (crowded
    machine), and every weight on a free one: the bits one thread gives either way."""
    rng = np.random.default_rng(3)
    columns = 576
    parts = (torch.from_numpy(rng.integers(0, 256, (out, columns // 2), dtype=np.uint8)),
             torch.from_numpy(rng.uniform(1e-3, 1e-2, (out, columns // 32)).astype(np.float32)),
             torch.from_numpy(rng.uniform(-0.05, 0.0, (out, columns // 32)).astype(np.float32)))
    linear = four_bit_linear([parts], None, columns)
    assert (linear.packed.nbytes >= PARALLEL_PACKED) == (out == 4096)
    x = torch.randn(1, columns).to(torch.bfloat16)
    torch.set_num_threads(1)
    alone = linear(x)
    torch.set_num_threads(2)  # the fixture restores the count
    assert torch.equal(linear(x), alone)
    with serial():
        assert torch.equal(linear(x), alone)


def test_plain_decoding_and_graft_give_the_same_tokens(four_bit_model):
    """Cold, and from a prefix-cache hit (a prompt that begins as the one before did): a hit's rows are the bits a
    cold prompt's are, as in bf16."""
    import graft_cli

    first, second = "the the he t the he he t", "the the he t the he he t t the"
    runs = {}
    for method in ("ar", "graft"):
        for cache in (0, 16):
            generator = graft_cli.load(str(four_bit_model), method=method, dtype="q4", threads=1, prefix_cache=cache)
            generator.generate(first, max_new_tokens=24)
            completion = generator.generate(second, max_new_tokens=24)
            runs[(method, cache)] = completion.token_ids
            assert (completion.stats.cached_tokens > 0) == (cache > 0)
    assert len(set(map(tuple, runs.values()))) == 1 and runs[("ar", 0)]


def test_refusals_are_one_line(four_bit_model, tmp_path):
    import graft_cli

    plain = tmp_path / "plain.gguf"
    tiny_gguf(plain)  # float32: nothing to keep
    refusals = ((lambda: load_model(str(plain), "cpu", "q4"), "keeps no quantized weights"),
                (lambda: graft_cli.load(str(four_bit_model), dtype="q4", forward="transformers"), "own forward"),
                (lambda: load_model(str(four_bit_model), "cuda", "q4"), "no CUDA device" if not torch.cuda.is_available()
                 else "a CPU mode"))
    for call, words in refusals:
        with pytest.raises(GraftError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.real_model
def test_the_default_model_in_four_bits_is_lossless():
    """The catalog's SmolLM2 GGUF is Q4_1: every linear kept in 4 bits; greedy and seeded, graft (with a draft
    model too) gives plain decoding's tokens over the same 4-bit weights."""
    from graft_cli.api import Generator
    from graft_cli.catalog import install
    from graft_cli.method.config import configure

    name = "smollm2-135m-instruct"
    if not (resolve.resolve_model(name) / q4.FILE).is_file():
        install.pull(name, force=True)  # pulled by a graft that did not keep 4-bit weights yet
    loaded = load_model(name, "cpu", "q4")
    assert sum(isinstance(m, FourBitLinear) for m in loaded.model.modules()) == 4 * 30  # qkv, o, gate-up, down
    prompts = ["Write a Python function that checks whether a string is a palindrome.",
               "Name three rivers of Europe and the seas they flow into."]
    for sampling in (dict(max_new_tokens=40), dict(max_new_tokens=24, temperature=0.8, seed=3)):
        runs = {method: [Generator(loaded, config).generate(p, **sampling).token_ids for p in prompts]
                for method, config in (("ar", configure("ar")), ("graft", configure("graft")),
                                       ("graft-draft", configure("graft", draft=name, depth=3)))}
        assert runs["ar"] == runs["graft"] == runs["graft-draft"], sampling


@pytest.mark.real_model
def test_the_draft_qwen_keeps_its_five_and_eight_bit_weights_losslessly():
    """The catalog's Qwen2.5-Coder-0.5B GGUF is Q4_K_M, but llama.cpp stored most of its linears as Q5_0 and Q8_0
    (its 896 columns do not fill Q4_K's blocks): kept as two planes, greedy and seeded graft gives plain decoding's
    tokens over them."""
    from graft_cli.api import Generator
    from graft_cli.catalog import install
    from graft_cli.method.config import configure

    name = "qwen2.5-coder-0.5b-instruct"
    if (read_manifest(resolve.resolve_model(name)) or {}).get("q4_weights") != 157:
        install.pull(name, force=True)  # pulled by a graft that kept only its 4-bit weights
    loaded = load_model(name, "cpu", "q4")
    planes = [m.planes for m in loaded.model.modules() if isinstance(m, FourBitLinear)]
    assert planes.count(2) > planes.count(1) > 0
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    for sampling in (dict(max_new_tokens=32), dict(max_new_tokens=16, temperature=0.8, seed=5)):
        ar, graft = (Generator(loaded, configure(method)).generate(prompt, **sampling).token_ids
                     for method in ("ar", "graft"))
        assert ar and ar == graft, sampling
