"""benchmarks/transport/gpu_real.py: the real-weights run for a lent GPU, its calls sized and timed to fit 12
minutes, and its --smoke run (the same code on this CPU, a tiny model): verdicts of the first-use check, graft
bench with the graphs on and off in bf16 and fp32, gpu_check's fixed-shape rows, all written into $OUT as it goes;
a run short of time skips what no longer fits and still returns what it measured."""

from __future__ import annotations

import json
import sys
import time
import zipfile

from benchmarks.transport import gpu_real as real, gpu_runbook as runbook
from tests.test_gpu_pack import _sparse_pieces


def test_the_plan_fits_12_minutes_and_64_mib(tmp_path):
    _sparse_pieces(tmp_path / "gpu", [37_000_000, 37_000_000, 18_871_040])
    (tmp_path / "gpu" / "questions.jsonl").write_text("{}\n")
    plan = real.real_plan(tmp_path / "gpu")
    text = runbook.plan_text(plan)
    assert "OVER" not in text and text.count("run(command=") == 3 and "gpu_real run --out $OUT" in text
    assert all(len(call.command) <= 2000 and len(call.carry) <= 8 for call in plan.calls)
    assert plan.calls[-1].timeout_s <= 7 * 60 and runbook.device_seconds(plan)[1] <= 12 * 60


def test_smoke_runs_every_step_and_writes_out_as_it_goes(tmp_path):
    setup = real.smoke_inputs(tmp_path)
    assert real.run_there(tmp_path, tmp_path / "out", setup, real.SMOKE_WITHIN_S, time.perf_counter) == 0
    out = sorted(f.name for f in (tmp_path / "out").iterdir())
    assert out == ["real.zip", "summary.json"]  # with the call's log: 3 files of $OUT's 8
    steps = json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]
    for dtype in ("bfloat16", "float32"):
        assert {name: v["ok"] for name, v in steps[f"verdicts {dtype}"].items()} == dict.fromkeys(real.METHODS, True)
        for graphs in ("on", "off"):
            bench = steps[f"bench {dtype} graphs {graphs}"]
            assert bench["exit"] == 0 and bench["lossless"]["ok"] and set(bench["overall"]) == set(real.METHODS)
    assert steps["gpu_check fixed"]["exit"] == 0
    with zipfile.ZipFile(tmp_path / "out" / "real.zip") as zf:
        names = set(zf.namelist())
    assert {"bfloat16-graphs-on/results.json", "float32-graphs-off/runs.jsonl", "fixed/gpu_check.json"} <= names

    # again on the same warm machine, with almost no time left: the verdicts are kept (no check), the benches
    # skipped, step 3 stopped at the deadline; what ran is still in $OUT, and the run says it did not pass
    assert real.run_there(tmp_path, tmp_path / "short", setup, 20, time.perf_counter) == 1
    steps = json.loads((tmp_path / "short" / "summary.json").read_text())["steps"]
    assert all(v["ok"] for v in steps["verdicts float32"].values())
    assert steps["bench bfloat16 graphs on"] == {"skipped": "out of time"} and not real.passed(steps)
    assert steps["gpu_check fixed"]["exit"] in (0, 124)
    assert real.run([sys.executable, "-c", "import time; time.sleep(60)"], 0.5) == 124  # stopped at its share
