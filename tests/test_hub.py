"""Models named by their Hugging Face hub id, resolved through huggingface_hub's own cache, written here in the
layout huggingface_hub writes (tests/hub_fixtures.py). No test reaches the network: the cache is read offline, and
the one download is huggingface_hub's API replaced by a stand-in that writes the files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from graft_cli.catalog import checksums, hub, resolve
from graft_cli.core import GraftError
from graft_cli.bench.synthetic import save_model_dir, tiny_model, word_tokenizer
from tests.hub_fixtures import add_snapshot, use_cache

A, B = "a" * 40, "b1" * 20  # two commits of org/tiny: main, and the tag v1
PROMPT = ["--raw", "-p", "t1 t2 t3 t4", "-n", "10", "--method", "ar"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny models (different weights) saved as plain Hugging Face directories."""
    root = tmp_path_factory.mktemp("sources")
    return [save_model_dir(root / f"m{seed}", tiny_model(seed=seed), word_tokenizer()) for seed in (0, 1)]


@pytest.fixture
def cache(tmp_path, sources, monkeypatch):
    """A hub cache under tmp_path/hf (HF_HOME) holding org/tiny at main (commit A) and v1 (commit B)."""
    hub_dir = tmp_path / "hf" / "hub"
    add_snapshot(hub_dir, "org/tiny", sources[0], A, refs=("main",))
    add_snapshot(hub_dir, "org/tiny", sources[1], B, refs=("v1",))
    use_cache(monkeypatch, hub_dir)
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "graft"))
    return hub_dir


def graft(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The real command in a fresh process, with HF_HOME (not a patched constant) naming the cache."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    environ |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "GRAFT_HOME": str(tmp_path / "graft"), **env}
    return subprocess.run([sys.executable, "-m", "graft_cli", *args], capture_output=True, text=True, timeout=300,
                          env=environ, cwd=tmp_path)


@pytest.mark.parametrize("spec, expected", [
    ("Qwen/Qwen2.5-7B-Instruct", hub.HubId("Qwen/Qwen2.5-7B-Instruct")),
    ("org/name@v1.0", hub.HubId("org/name", "v1.0")),
    ("org/name@refs/pr/3", hub.HubId("org/name", "refs/pr/3")),
    ("smollm2-135m-instruct", None), ("./org/name", None), ("/abs/path", None), ("a/b/c", None),
    ("org/model.gguf", None), ("~/x/y", None), ("org/name@", None),
])
def test_what_is_a_hub_id(spec, expected):
    assert hub.parse_hub_id(spec) == expected


def test_a_cached_id_resolves_offline_to_its_snapshot(cache):
    path = resolve.resolve_model("org/tiny")
    assert path == cache / "models--org--tiny" / "snapshots" / A and (path / "config.json").is_symlink()


@pytest.mark.parametrize("revision, commit", [("", A), ("@main", A), ("@v1", B), (f"@{B}", B), ("@b1b1b1b", B),
                                              (f"@{A}", A)])
def test_the_revision_picks_the_snapshot(cache, revision, commit):
    assert resolve.resolve_model(f"org/tiny{revision}").name == commit


def test_missing_ids_and_revisions_are_one_line_naming_the_cache(cache):
    for spec in ("org/absent", "org/tiny@v9", "org/tiny@cccccccc"):
        with pytest.raises(GraftError) as e:
            resolve.resolve_model(spec)
        message = str(e.value)
        assert spec in message and str(cache) in message and "HF_HUB_OFFLINE" in message and "\n" not in message


def test_a_partial_snapshot_says_what_it_lacks(cache, sources):
    add_snapshot(cache, "org/half", sources[0], A, files=["config.json", "tokenizer.json"])
    with pytest.raises(GraftError, match=r"only partly in the Hugging Face cache .* lacks weights"):
        resolve.resolve_model("org/half")


def test_precedence_catalog_then_path_then_hub(cache, tmp_path, sources, monkeypatch):
    """A local directory spelled ORG/NAME wins over the hub id; a catalog name is never looked up on the hub."""
    local = tmp_path / "work" / "org" / "tiny"
    save_model_dir(local, tiny_model(seed=2), word_tokenizer())
    monkeypatch.chdir(tmp_path / "work")
    assert resolve.resolve_model("org/tiny").resolve() == local.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve.resolve_model("org/tiny").name == A
    with pytest.raises(GraftError, match="not pulled yet"):  # the catalog's, not a hub lookup
        resolve.resolve_model("smollm2-135m-instruct", pull_if_missing=False)
    with pytest.raises(GraftError, match=r"unknown model 'nothing-at-all': .* nor a Hugging Face id"):
        resolve.resolve_model("nothing-at-all")


def test_a_snapshot_is_identified_by_its_blobs_and_nothing_is_written_there(cache, sources):
    import hashlib

    path = resolve.resolve_model("org/tiny")
    weights = (sources[0] / "model.safetensors").read_bytes()
    assert checksums.model_checksum(path) == hashlib.sha256(weights).hexdigest()
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in sources[0].iterdir()
                                                            if not p.name.startswith("."))
    assert resolve.model_info("org/tiny")["commit"] == A


def test_not_cached_with_the_network_off_pull_is_one_line(cache, capsys):
    from tests.test_cli import run_main

    code, out, err = run_main(["models", "pull", "org/tiny@v1"], capsys)
    assert code == 0 and out.strip() == str(cache / "models--org--tiny" / "snapshots" / B)
    code, out, err = run_main(["models", "pull", "org/absent"], capsys)
    assert code == 2 and err.count("\n") == 1 and "org/absent" in err and str(cache) in err
    assert "Traceback" not in err


def test_a_download_is_announced_with_its_size_and_fetches_only_what_graft_reads(cache, sources, monkeypatch, capsys):
    """With the network on (here: huggingface_hub's two calls stood in for), one line says what is fetched and
    how many bytes before anything is; other frameworks' weights and subfolders are left on the hub."""
    import huggingface_hub

    use_cache(monkeypatch, cache, offline=False)
    files = {"config.json": 700, "generation_config.json": 100, "tokenizer.json": 3000, "tokenizer_config.json": 300,
             "model.safetensors": 5_000_000, "pytorch_model.bin": 5_000_000, "tf_model.h5": 5_000_000,
             "onnx/model.onnx": 5_000_000, "README.md": 10}
    info = SimpleNamespace(sha="c" * 40, siblings=[SimpleNamespace(rfilename=n, size=s) for n, s in files.items()])
    asked = {}

    def snapshot_download(repo, revision=None, allow_patterns=None, force_download=False):
        asked.update(repo=repo, revision=revision, files=sorted(allow_patterns))
        return str(add_snapshot(cache, repo, sources[0], "c" * 40, refs=("main",)))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, revision, files_metadata: info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = resolve.resolve_model("org/fresh")
    err = capsys.readouterr().err
    assert path.name == "c" * 40 and err.count("\n") == 1
    assert "org/fresh@main" in err and "5 files" in err and "5,004,100 bytes" in err and str(cache) in err
    assert asked == {"repo": "org/fresh", "revision": None, "files": ["config.json", "generation_config.json",
                                                                       "model.safetensors", "tokenizer.json",
                                                                       "tokenizer_config.json"]}


def test_a_draft_model_by_hub_id(cache, sources, capsys):
    """``--draft ORG/NAME[@REVISION]`` names a draft model the same way (here: the other weights, at tag v1)."""
    from tests.test_cli import run_main

    args = ["generate", "--model", str(sources[0]), "--raw", "-p", "t1 t2 t3 t4", "-n", "10"]
    code, plain, _ = run_main([*args, "--method", "ar"], capsys)
    drafted_code, drafted, err = run_main([*args, "--method", "dense", "--draft", "org/tiny@v1"], capsys)
    assert code == drafted_code == 0, err
    assert drafted == plain and plain.split()


@pytest.mark.parametrize("names, weights", [
    (["model.safetensors", "pytorch_model.bin"], ["model.safetensors"]),
    (["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "consolidated.safetensors", "pytorch_model.bin"],
     ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]),
    (["pytorch_model.bin", "flax_model.msgpack", "tf_model.h5"], ["pytorch_model.bin"]),
    (["original/consolidated.pth", "onnx/model.onnx"], []),
])
def test_one_weight_format_is_chosen(names, weights):
    chosen = hub.wanted_files(["config.json", "README.md", *names])
    assert sorted(chosen) == sorted(["config.json", *weights])


def test_generate_by_hub_id_equals_the_same_weights_by_path(cache, tmp_path, sources):
    """A real process, the cache named by HF_HOME alone, the network off: the hub id gives the very tokens of the
    directory it came from, and @v1 another answer (other weights; the revision's resolution is tested above)."""
    by_id = graft(["generate", "--model", "org/tiny", *PROMPT], tmp_path)
    by_path = graft(["generate", "--model", str(sources[0]), *PROMPT], tmp_path)
    by_tag = graft(["generate", "--model", "org/tiny@v1", *PROMPT], tmp_path)
    assert by_id.returncode == 0 and by_tag.returncode == 0, by_id.stderr + by_tag.stderr
    assert by_id.stdout == by_path.stdout and by_id.stdout.split()
    assert by_tag.stdout.split() and by_tag.stdout != by_id.stdout  # the tag's weights (commit B) answered


def test_a_missing_id_is_one_line_and_exit_2(tmp_path):
    run = graft(["generate", "--model", "org/absent", *PROMPT], tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "org/absent" in run.stderr and str(tmp_path / "hf" / "hub") in run.stderr


@pytest.mark.real_model
def test_the_default_model_by_its_hub_id(tmp_path):
    """The catalog's default model, put into a hub cache as HuggingFaceTB/SmolLM2-135M-Instruct (its files linked,
    not copied), generates the very text the catalog name does."""
    source = resolve.resolve_model("smollm2-135m-instruct")
    add_snapshot(tmp_path / "hf" / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", source, "d" * 40, link=True,
                 files=[p.name for p in source.iterdir() if p.is_file() and not p.name.startswith((".", "graft-"))])
    prompt = ["-p", "Name the capital of France.", "-n", "16", "--method", "ar"]
    by_id = graft(["generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", *prompt], tmp_path,
                  GRAFT_HOME=str(source.parents[1]))
    by_name = graft(["generate", "--model", "smollm2-135m-instruct", *prompt], tmp_path,
                    GRAFT_HOME=str(source.parents[1]))
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == by_name.stdout and "Paris" in by_id.stdout
