"""The catalog's GGUF side: a real (tiny, random) GGUF written here, corrupt files refused in one line, the real
conversion checked by its logits, a local .gguf converted once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from graft_cli.catalog import checksums, gguf, install, resolve
from graft_cli.catalog.home import MANIFEST, read_manifest
from graft_cli.core import GraftError
from tests.catalog_fixtures import fake_convert, home, leftovers  # noqa: F401 - home: the fixture



def _byte_chars() -> list[str]:
    """The 256 printable stand-ins that byte-level BPE vocabularies use for raw bytes."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _tiny_gguf(path: Path, *, chat_template: bool = True) -> None:
    """A real (random, float32) one-layer Llama GGUF with a byte-level BPE tokenizer: a few KB, loads in transformers."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    hidden, inter, heads, kv_heads = 16, 32, 2, 1
    tokens = _byte_chars() + ["\u0120t", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    w.add_token_merges(["\u0120 t", "h e"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    if chat_template:
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    kv_dim = hidden // heads * kv_heads
    tensors = {
        "token_embd.weight": rand(vocab, hidden),
        "output_norm.weight": np.ones(hidden, np.float32),
        "output.weight": rand(vocab, hidden),
        "blk.0.attn_norm.weight": np.ones(hidden, np.float32),
        "blk.0.ffn_norm.weight": np.ones(hidden, np.float32),
        "blk.0.attn_q.weight": rand(hidden, hidden),
        "blk.0.attn_k.weight": rand(kv_dim, hidden),
        "blk.0.attn_v.weight": rand(kv_dim, hidden),
        "blk.0.attn_output.weight": rand(hidden, hidden),
        "blk.0.ffn_gate.weight": rand(inter, hidden),
        "blk.0.ffn_up.weight": rand(inter, hidden),
        "blk.0.ffn_down.weight": rand(hidden, inter),
    }
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "content",
    [b"", b"hello, not a gguf\n", b"GGUF\x03\x00\x00\x00", "truncated"],
    ids=["empty", "junk", "header-only", "truncated"],
)
def test_corrupt_gguf_is_one_line_error(home, tmp_path, content):
    f = tmp_path / "broken.gguf"
    if content == "truncated":
        _tiny_gguf(f)
        f.write_bytes(f.read_bytes()[:-40])
    else:
        f.write_bytes(content)
    with pytest.raises(GraftError) as err:
        resolve.resolve_model(str(f))
    assert str(err.value).startswith(f"cannot read GGUF file {f}: ")
    assert "\n" not in str(err.value)
    assert not (home / "models").exists() or not any((home / "models").iterdir())
    assert leftovers(home) == []


def test_tiny_gguf_parses(tmp_path):
    f = tmp_path / "ok.gguf"
    _tiny_gguf(f)
    facts = gguf.check_gguf(f)
    assert facts == {"architecture": "llama", "tensors": 12, "has_chat_template": True}


def test_real_conversion_of_a_tiny_gguf(home, tmp_path):
    """The real convert path (no stub): dequantise, rebuild, save, reload with identical logits; the ChatML
    fallback when the GGUF has no chat template. Offline: the GGUF is written here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for with_template, source in ((True, "gguf"), (False, "chatml-fallback")):
        f = tmp_path / f"tiny-{source}.gguf"
        _tiny_gguf(f, chat_template=with_template)
        path = resolve.resolve_model(str(f))
        manifest = read_manifest(path)
        assert manifest["chat_template"] == source
        assert manifest["architecture"] == "LlamaForCausalLM" and manifest["verified_logits_max_abs_diff"] == 0.0
        assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= {p.name for p in path.iterdir()}
        tok = AutoTokenizer.from_pretrained(path)
        text = tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False)
        assert text.startswith("<|im_start|>user\nthe<|im_end|>")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert "quantization_config" not in json.loads((path / "config.json").read_text())
        assert model.config.vocab_size == 261
    assert leftovers(home) == []


def test_local_gguf_is_converted_once(home, tmp_path, monkeypatch):
    f = tmp_path / "mine.gguf"
    _tiny_gguf(f)
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(gguf_path)
        return fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(install, "convert_gguf", convert)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    path = resolve.resolve_model(str(f))
    assert path == home / "models" / f"gguf-{sha[:12]}"
    assert resolve.resolve_model(str(f)) == path
    assert resolve.resolve_model(f"gguf-{sha[:12]}") == path  # by its name, too
    assert len(calls) == 1
    assert checksums.model_checksum(path) == sha
    manifest = resolve.model_info(path.name)
    assert manifest["kind"] == "local-gguf" and manifest["source"]["gguf_path"] == str(f.resolve())
    assert path.name in {r["name"] for r in resolve.list_models()}
    install.remove(path.name)
    assert not path.exists()
    assert leftovers(home) == []
