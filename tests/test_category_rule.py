"""benchmarks/category_rule.py judges issue 17's per-category rule over passes, beside the noise floor."""

import json
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script


def results(tmp_path: Path, name: str, speedups: dict[str, dict[str, float]], tau: float = 2.0) -> Path:
    """A results.json whose summary has these speedups per category and method (and an overall row)."""
    summary = {cat: {m: {"speedup": s, "tau": tau} for m, s in row.items()} for cat, row in speedups.items()}
    path = tmp_path / name / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"summary": summary}))
    return path


def test_passes_twins_and_the_noise_floor(tmp_path, monkeypatch, capsys):
    rule = load_script("category_rule")
    path = results(tmp_path, "run", {
        "qa": {"pld": 1.0, "hf-pld": 1.2, "graft": 1.5, "pld-b": 1.1, "graft-b": 1.1},
        "overall": {"pld": 1.0, "hf-pld": 1.1, "graft": 1.2, "pld-b": 1.0, "graft-b": 1.3},
    })
    found = dict(rule.passes([path], "graft", ["pld", "hf-pld"], "-b", None))
    assert found["run:graft"]["qa"] == pytest.approx(1.5 / 1.2)
    assert found["run:graft-b"]["qa"] == pytest.approx(1.1 / 1.2)  # against pld-b (1.1) and hf-pld (1.2)
    floor = dict(rule.noise([path], "-b"))
    assert floor["run:pld-b/pld"]["qa"] == pytest.approx(1.1)
    assert floor["run:graft-b/graft"]["overall"] == pytest.approx(1.3 / 1.2)
    assert "under 0.97: 1/2" in rule.table(list(found.items()), 0.97).splitlines()[0]
    monkeypatch.setattr(sys, "argv", ["category_rule.py", str(path)])
    assert rule.main() == 0
    assert "noise floor" in capsys.readouterr().out


def test_other_settings_and_missing_methods_are_left_out(tmp_path, monkeypatch, capsys):
    rule = load_script("category_rule")
    other = results(tmp_path, "other", {"overall": {"pld": 1.0, "hf-pld": 1.0, "graft": 1.1}}, tau=2.5)
    lacking = results(tmp_path, "lacking", {"overall": {"pld": 1.0, "graft": 1.1}})
    assert rule.passes([other], "graft", ["pld", "hf-pld"], "-b", 2.0) == []
    assert rule.passes([lacking], "graft", ["pld", "hf-pld"], "-b", None) == []
    monkeypatch.setattr(sys, "argv", ["category_rule.py", str(lacking)])
    assert rule.main() == 1
    assert "no pass has graft" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["category_rule.py", str(tmp_path / "absent.json")])
    assert rule.main() == 1
