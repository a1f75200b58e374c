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
from tests.catalog_fixtures import fake_convert, home, leftovers, tiny_gguf  # noqa: F401 - home: the fixture


@pytest.mark.parametrize(
    "content",
    [b"", b"hello, not a gguf\n", b"GGUF\x03\x00\x00\x00", "truncated"],
    ids=["empty", "junk", "header-only", "truncated"],
)
def test_corrupt_gguf_is_one_line_error(home, tmp_path, content):
    f = tmp_path / "broken.gguf"
    if content == "truncated":
        tiny_gguf(f)
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
    tiny_gguf(f)
    facts = gguf.check_gguf(f)
    assert facts == {"architecture": "llama", "tensors": 12, "has_chat_template": True}


def test_real_conversion_of_atiny_gguf(home, tmp_path):
    """The real convert path (no stub): dequantise, rebuild, save, reload with identical logits; the ChatML
    fallback when the GGUF has no chat template. Offline: the GGUF is written here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for with_template, source in ((True, "gguf"), (False, "chatml-fallback")):
        f = tmp_path / f"tiny-{source}.gguf"
        tiny_gguf(f, chat_template=with_template)
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
    tiny_gguf(f)
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
