"""benchmarks/gpu_projection.py prices a bench run's counts with a GPU's costs."""

import json
import sys

import pytest

from tests.scripts import load_script


def turn(decoded: int, steps: int, nodes: int = 0, forwards: int = 0) -> dict:
    return {"new_tokens": decoded + 1, "first_tokens": 1, "steps": steps, "draft_forwards": forwards,
            "proposed": {"draft": nodes} if nodes else {}}


def test_a_run_is_priced_by_the_gpu_curve(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs.jsonl"
    records = [{"method": "ar", "turns": [turn(10, 10)]},
               {"method": "graft", "turns": [turn(10, 5, nodes=20, forwards=10)]},  # 4 nodes, 2 draft forwards a step
               {"method": "dense", "turns": [turn(10, 2, nodes=2 * 127)]}]  # 127 nodes a step: 128 tokens fed
    runs.write_text("".join(json.dumps(r) + "\n" for r in records))
    projection = load_script("gpu_projection")
    table = projection.project(records, projection.LatencyModel.default("cuda"), share=0.1)
    assert table["ar"]["speedup"] == pytest.approx(1.0) and table["ar"]["tau"] == 1.0
    assert table["graft"]["tau"] == 2.0 and table["graft"]["nodes_per_step"] == 4.0
    assert table["graft"]["speedup"] == pytest.approx(10 / (5 * (1.0 + 2 * 0.1)))  # a flat curve below 16 tokens
    assert table["dense"]["speedup"] == pytest.approx(10 / (2 * 1.35))  # the curve's last point
    monkeypatch.setattr(sys, "argv", ["gpu_projection.py", str(runs), "--curve", "1:1,128:2"])
    assert projection.main() == 0
    assert "dense" in capsys.readouterr().out
