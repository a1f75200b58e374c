"""The real-weights check on a lent GPU, in one call of at most 7 minutes after the default model's pieces (carried
by the calls before it, as in the head plan):

1. graft installed there (``pip install --no-deps .``, by the call's command), so its entry points are registered;
2. the first-use check's verdict on the captured path (graft_cli/api/capture_check.py) for ar, pld, graft and graft
   with the shipped head, in bf16 and fp32; then ``graft bench``'s tie-aware lossless check and speeds on the 16
   carried Spec-Bench questions for the same four methods, in bf16 and fp32, each with ``--graphs on`` and
   ``--graphs off``;
3. gpu_check.py's fixed-shape rows on the 8B-shaped random-weight model, its token rows included.

Everything goes into ``$OUT`` as it comes: ``summary.json`` (verdicts, lossless reports, speeds, exit codes) and
``real.zip`` (each bench's results.json and runs.jsonl, gpu_check.json), both rewritten whole after each step,
beside the call's log; a call cut off at its limit returns what it measured. Each step gets a share of what is
left of the call's time, and what no longer fits is recorded as skipped.

    python -m benchmarks.transport.gpu_real plan               # here: the calls, sized and timed (12 minutes)
    python3 -m benchmarks.transport.gpu_real run --out $OUT    # there: the last call
    python -m benchmarks.transport.gpu_real smoke              # here: the same code on this CPU, a tiny model (CI)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from datastores.atomic import atomic_file, write_json_atomic
from graft_cli.core import GraftError

from benchmarks.transport.gpu_machine import carry_model_dir, environ, environment, install_model
from benchmarks.transport.gpu_runbook import PACK, ROOT, SITE, Call, Plan, piece_calls, plan_text, relative

CALL_S = 420  # the call's timeout_s: at most 7 minutes
WITHIN_S = CALL_S - 40  # from the Python command's start: pip installs graft and the wheels before it
FIXED_S = 110  # of that, kept for step 3
REAL_LIMIT_S = 12 * 60
QUESTIONS = "questions.jsonl"
SHIPPED_HEAD = "eagle3:smollm2-135m-instruct-eagle3"
METHODS = ("ar", "pld", "graft", "head")  # head: graft with the shipped head (a --variant of graft)
RUNS = (("bfloat16", "on"), ("bfloat16", "off"), ("float32", "on"), ("float32", "off"))
FIXED_ONLY = ("--skip", "greedy,sampling,exact,latency,host,compiled")  # gpu_check.py: its fixed-shape rows
# alone, uncompiled (compiling the 8B model takes minutes: its own call, docs/gpu.md "The compiled path")


@dataclass(frozen=True)
class Setup:
    """Where the steps run: the GPU's settings, or the smoke run's on this CPU (the same code)."""

    device: str
    head: str  # the --draft of the head column
    max_new_tokens: int
    fixed: tuple[str, ...]  # gpu_check.py's arguments
    capture: Callable[[], object]  # how the verdicts' target records its graphs


def gpu_setup() -> Setup:
    from graft_cli.runtime.graphs import CudaCapture

    return Setup("cuda", SHIPPED_HEAD, 128, FIXED_ONLY, CudaCapture)


class Results:
    """What the call has measured so far, rewritten whole into ``out`` after each step: ``summary.json`` and
    ``real.zip`` (every file under ``stage``)."""

    def __init__(self, out: Path, stage: Path) -> None:
        self.out, self.stage, self.summary = out, stage, {"device": environment(), "steps": {}}
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)  # an earlier try's, on a warm machine
        stage.mkdir(parents=True)

    def add(self, step: str, value: object) -> None:
        self.summary["steps"][step] = value
        write_json_atomic(self.out / "summary.json", self.summary)
        with atomic_file(self.out / "real.zip") as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for f in sorted(self.stage.rglob("*")):
                if f.is_file():
                    zf.write(f, f.relative_to(self.stage).as_posix())


def configs(setup: Setup) -> dict:
    from graft_cli.method.config import configure

    return {"ar": configure("ar"), "pld": configure("pld"), "graft": configure("graft"),
            "head": configure("graft", draft=setup.head)}


def verdicts(model: str, setup: Setup, dtype: str) -> dict:
    """The first-use check's verdict for each method on the captured path (kept under GRAFT_HOME, as for users)."""
    from graft_cli.api.capture_check import first_use
    from graft_cli.method import builder as methods
    from graft_cli.runtime.fixed_target import FixedShapeTarget
    from graft_cli.runtime.loading import load_model

    loaded = load_model(model, setup.device, dtype)
    out = {}
    for name, config in configs(setup).items():
        try:
            target = FixedShapeTarget(loaded.model, capture=setup.capture())
            verdict = first_use(loaded, config, target, methods.build(config, loaded, target))
            out[name] = asdict(verdict)
        except (GraftError, RuntimeError) as e:
            out[name] = {"ok": None, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
    return out


def bench(model: str, setup: Setup, questions: Path, dtype: str, graphs: str, dest: Path, timeout: float) -> dict:
    """``graft bench`` on the questions for the four methods; its exit, lossless report and overall speeds."""
    argv = [sys.executable, "-m", "graft_cli", "bench", "--model", model, "--dataset", str(questions),
            "--methods", ",".join(METHODS), "--variant", f"head=graft draft={setup.head}", "--dtype", dtype,
            "--graphs", graphs, "--device", setup.device, "--max-new-tokens", str(setup.max_new_tokens),
            "--no-plots", "--out", str(dest)]
    rc = run(argv, timeout)
    try:
        results = json.loads((dest / "results.json").read_text())
    except (OSError, ValueError):
        return {"exit": rc, "results": None}
    overall = results["summary"].get("overall", {})
    speeds = {m: {k: row.get(k) for k in ("tokens_per_s", "speedup", "tau")} for m, row in overall.items()}
    return {"exit": rc, "complete": results.get("complete"), "lossless": results["lossless"], "overall": speeds}


def run(argv: list[str], timeout: float) -> int:
    """A step's process, its output into the call's; 124 when it ran past ``timeout`` (it is stopped)."""
    print("$ " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    try:
        return subprocess.run(argv, timeout=max(timeout, 1)).returncode
    except subprocess.TimeoutExpired:
        return 124


def run_there(folder: Path, out: Path, setup: Setup, within: float, clock: Callable[[], float]) -> int:
    """Steps 2 and 3 after the model's install, each written into ``out`` as it ends; returns 0 when every
    verdict passed, every bench was lossless and every step ran."""
    end = clock() + within
    with environ(GRAFT_HOME=str((folder / "home").resolve()), HF_HUB_OFFLINE="1"):
        model = install_model(folder)
        results = Results(out, folder / "real")
        results.add("install", {"model": model, "seconds_left": round(end - clock())})
        for dtype in ("bfloat16", "float32"):
            results.add(f"verdicts {dtype}", verdicts(model, setup, dtype))
        for n, (dtype, graphs) in enumerate(RUNS):
            left = end - FIXED_S - clock()
            name = f"bench {dtype} graphs {graphs}"
            if left < 20:
                results.add(name, {"skipped": "out of time"})
                continue
            dest = folder / "real" / f"{dtype}-graphs-{graphs}"
            results.add(name, bench(model, setup, folder / QUESTIONS, dtype, graphs, dest, left / (len(RUNS) - n)))
        argv = [sys.executable, "-m", "benchmarks.gpu_check", *setup.fixed, "--out", str(folder / "real" / "fixed")]
        results.add("gpu_check fixed", {"exit": run(argv, end - clock() - 5)})
    return 0 if passed(results.summary["steps"]) else 1


def passed(steps: dict) -> bool:
    """Every verdict ok, every bench ran whole and lossless (ties allowed), gpu_check passed."""
    for name, step in steps.items():
        if name.startswith("verdicts") and not all(v.get("ok") for v in step.values()):
            return False
        if name.startswith("bench") and not (step.get("exit") == 0 and step.get("lossless", {}).get("ok")):
            return False
        if name.startswith("gpu_check") and step.get("exit") != 0:
            return False
    return True


def real_plan(folder: Path) -> Plan:
    """The pieces' calls (the head plan's), then this one call of at most 7 minutes."""
    rel = relative(folder)
    calls, last = piece_calls(folder, PACK)
    command = (f"set -o pipefail; {SITE} {rel}/whl/*.whl . && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 "
               f"python3 -m benchmarks.transport.gpu_real run --out $OUT 2>&1 | tee $OUT/run.log")
    calls.append(Call(command, (last, f"{rel}/model.json", f"{rel}/{QUESTIONS}", f"{rel}/whl"), CALL_S, CALL_S - 10,
                      "the last piece; graft installed; verdicts, then graft bench on 16 questions (bf16, fp32; "
                      "--graphs on, off), then gpu_check's fixed-shape rows; $OUT written after each step"))
    return Plan(calls, REAL_LIMIT_S, ["then give_back(); keep the call's files (files_at) under docs/bench/:",
                                      "  summary.json, real.zip, run.log"])


# --- the smoke run: the same code on this CPU --------------------------------------------------------------------

def smoke_inputs(folder: Path) -> Setup:
    """What the smoke run carries: a tiny random Llama in pieces, a random head, two questions; and its setup:
    the CPU stand-in capture for the verdicts, gpu_check's smoke scale for step 3."""
    from graft_cli.bench.synthetic import ReplayCapture, synthetic_models

    target, head = synthetic_models(folder / "src", layers=4)
    carry_model_dir(target, folder)
    lines = [{"question_id": i, "category": "smoke", "turns": [" ".join(f"t{5 + (i + j) % 4}" for j in range(12))]}
             for i in range(2)]
    (folder / QUESTIONS).write_text("".join(json.dumps(q) + "\n" for q in lines))
    return Setup("cpu", f"eagle3:{head}", 12, ("--smoke", "--prompts", "1", "--new-tokens", "8", *FIXED_ONLY),
                 ReplayCapture)


SMOKE_WITHIN_S = FIXED_S + 300


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".gpu", help="the git-ignored folder that travels")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("plan", help="here: the run calls, sized against 64 MiB and timed against 12 minutes")
    p = sub.add_parser("run", help="there: the last call's steps, into --out")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--within", type=float, default=WITHIN_S, help="seconds the call has from this command's start")
    sub.add_parser("smoke", help="here: the same code on this CPU with a tiny model (CI)")
    args = parser.parse_args(argv)
    try:
        if args.verb == "plan":
            text = plan_text(real_plan(args.dir))
            print(text)
            return 1 if "OVER" in text else 0
        if args.verb == "run":
            return run_there(args.dir, args.out, gpu_setup(), args.within, time.perf_counter)
        with tempfile.TemporaryDirectory(prefix="gpu-real-smoke-") as tmp:
            rc = run_there(Path(tmp), Path(tmp) / "out", smoke_inputs(Path(tmp)), SMOKE_WITHIN_S, time.perf_counter)
            print((Path(tmp) / "out" / "summary.json").read_text())
            return rc
    except GraftError as e:
        print(f"gpu_real: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
