"""The run calls that train the default model's head on a lent GPU (gpu_pack.py, beside this file), each sized
against what one call may carry: the working tree that travels (tracked files and untracked ones git does not
ignore) plus the ignored paths it names in ``carry``, at most 64 MiB together. A machine is given back 30 s after
a call ends, and with it the pieces of earlier calls, so the calls go back to back; the 15 minutes of device time
hold the machine's start (a minute or more), each call's transfer and the runs.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL_LIMIT = 64 << 20
ASSUMED_TREE = 25_000_000  # the docs-as-manual work brings the tracked tree to this or less
PACK = "benchmarks.transport.gpu_pack"  # the module every call runs, from the checkout's root
SHIP_TO = "graft_cli/heads/shipped/smollm2-135m-instruct-eagle3"  # replacing the head trained on a CPU
SITE = "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site"


@dataclass(frozen=True)
class Call:
    command: str
    carry: tuple[str, ...]
    timeout_s: int
    why: str


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what every call sends: tracked files that exist and untracked files git does not ignore."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    paths = {root / n.decode() for n in names if n}
    return sum(p.lstat().st_size for p in paths if p.is_symlink() or p.is_file())


def path_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def calls(folder: Path) -> list[Call]:
    """The calls in order, read off the pieces manifest under ``folder``."""
    folder = folder.resolve()
    rel = folder.relative_to(ROOT).as_posix() if folder.is_relative_to(ROOT) else str(folder)
    manifest = json.loads((folder / "model.json").read_text())
    count = len(manifest["pieces"])
    out = [Call(f"python3 -m {PACK} check {i}", (f"{rel}/model.part{i}", f"{rel}/model.json"), 120,
                f"piece {i} of {count} arrives; pieces 1..{i} are checked, the machine's versions printed")
           for i in range(1, count)]
    train = (f"set -o pipefail; {SITE} {rel}/whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 "
             f"python3 -m {PACK} train --out $OUT 2>&1 | tee $OUT/train.log")
    out.append(Call(train, (f"{rel}/model.part{count}", f"{rel}/model.json", f"{rel}/corpus.npz", f"{rel}/whl"), 540,
                    f"the last piece; join, pull, train 6 min in bf16, export the head into $OUT"))
    bench = (f"{SITE} {rel}/whl/*.whl . && export GRAFT_HOME=$PWD/{rel}/home PYTHONPATH=/tmp/site "
             f"PYTHONUNBUFFERED=1 && B='python3 -m graft_cli bench --dataset {rel}/questions.jsonl "
             "--max-new-tokens 128 --device cuda --no-plots' && "
             "{ $B --methods ar,pld,graft --dtype bfloat16 --out $OUT/bf16; "
             "$B --methods ar,graft --draft eagle3:smollm2-135m-instruct-eagle3 --dtype bfloat16 --out $OUT/head; "
             "$B --methods ar,pld,graft --dtype float32 --out $OUT/fp32; } 2>&1 | tee $OUT/real.log")
    out.append(Call(bench, (f"{rel}/questions.jsonl",), 300,
                    "only if status gives budget_left_s >= 360: the real default model on 16 Spec-Bench questions: "
                    "every method against ar (bf16 tie-aware, fp32 identical) and the speed of ar, pld and graft "
                    "with the shipped head and without"))
    return out


def plan_text(folder: Path) -> str:
    """The runbook with every call's size now and under the assumed final tree; a call over 64 MiB says OVER."""
    tree = tree_bytes()
    lines = [f"tree that travels now: {tree / 1e6:.1f} MB (the plan assumes at most {ASSUMED_TREE / 1e6:.0f} MB); "
             f"one call carries at most {CALL_LIMIT / 1e6:.1f} MB",
             "issue these run calls back to back (a machine goes back 30 s after a call, with the pieces):"]
    for n, call in enumerate(calls(folder), 1):
        carried = sum(path_bytes(ROOT / p) for p in call.carry)
        size, worst = tree + carried, max(tree, ASSUMED_TREE) + carried
        flag = "OVER 64 MiB" if worst > CALL_LIMIT else "ok"
        lines += [f"call {n}: {call.why}",
                  f"  run(command={call.command!r},",
                  f"      carry={json.dumps(list(call.carry))}, timeout_s={call.timeout_s})",
                  f"  carries {carried / 1e6:.1f} MB: {size / 1e6:.1f} MB with today's tree, "
                  f"{worst / 1e6:.1f} MB with a {max(tree, ASSUMED_TREE) / 1e6:.0f} MB tree: {flag}"]
    lines += ["then give_back(); here, with the files of the train call (its files_at folder):",
              f"  python -m {PACK} import FILES_AT --ship {SHIP_TO}"]
    return "\n".join(lines)
