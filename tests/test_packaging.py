"""The install scheme: FAISS from exactly one wheel (faiss-cpu in [cpu], faiss-gpu-cu12 in [cuda]; both install the
module `faiss`), a clear error when neither is there, and the n-gram index placed on the model's GPU number."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from datastores import ngram_faiss
from datastores.errors import DatastoreError

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_no_install_path_brings_both_faiss_wheels():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    names = lambda deps: {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in deps}
    base, extras = names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}
    assert not base & {"faiss-cpu", "faiss-gpu-cu12"}
    assert "faiss-cpu" in extras["cpu"] and "faiss-gpu-cu12" in extras["cuda"]
    for extra in extras.values():
        assert len(extra & {"faiss-cpu", "faiss-gpu-cu12", "faiss-gpu"}) <= 1


def test_missing_faiss_is_a_one_line_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss now raises ImportError
    with pytest.raises(DatastoreError, match=r"need FAISS: pip install 'graft-sd\[cpu\]'.*'graft-sd\[cuda\]'"):
        ngram_faiss.import_faiss()


def test_the_index_goes_to_the_models_gpu_number():
    assert [ngram_faiss._gpu_of(d) for d in ("cuda", "cuda:0", "cuda:3", "cpu")] == [0, 0, 3, 0]
