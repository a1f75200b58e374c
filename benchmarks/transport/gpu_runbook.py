"""The run calls of a plan for a lent GPU, each sized against what one call may carry and timed against the
device time the plan may spend. A call carries the working tree that travels (tracked files and untracked ones git
does not ignore) plus the ignored paths it names in ``carry``, at most 64 MiB together. A machine is given back
30 s after a call ends, and with it the pieces of earlier calls, so the calls go back to back; the device time
holds the machine's start (1-2 minutes), each call's transfer and its run, so a plan's worst case, every call at
its timeout, must fit its limit.

Two plans use it: the head's training (``head_plan``, gpu_pack.py) and the real-weights check (gpu_real.py).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL_LIMIT = 64 << 20
ASSUMED_TREE = 25_000_000  # the tracked tree stays under this (the project's rule)
START_S = 120  # a machine's start: one to two minutes, counted at two
TRANSFER_S = 20  # each call's own cost around its command: the tree and what it carries sent, $OUT back
CHECK_S = (25, 60)  # a piece call: the sha256 of its piece and torch imported to name the machine; its timeout
PACK = "benchmarks.transport.gpu_pack"  # the module every call of the head plan runs, from the checkout's root
SHIP_TO = "graft_cli/heads/shipped/smollm2-135m-instruct-eagle3"  # replacing the head trained on a CPU
SITE = "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site"
HEAD_LIMIT_S = 13 * 60


@dataclass(frozen=True)
class Call:
    command: str
    carry: tuple[str, ...]
    timeout_s: int
    expected_s: int  # what the command should take; the plan's worst case counts timeout_s instead
    why: str


@dataclass(frozen=True)
class Plan:
    calls: list[Call]
    limit_s: int  # device time the whole plan may spend, the machine's start included
    after: list[str]  # what to do here afterwards, one line each


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


def relative(folder: Path) -> str:
    """``folder`` as the calls name it: relative to the checkout's root, where they run."""
    folder = folder.resolve()
    return folder.relative_to(ROOT).as_posix() if folder.is_relative_to(ROOT) else str(folder)


def piece_calls(folder: Path, module: str) -> tuple[list[Call], str]:
    """A call for each model piece but the last (which rides with the plan's main call), each checking the
    pieces so far; and the last piece's path."""
    rel = relative(folder)
    if not (folder / "model.json").is_file():
        raise SystemExit(f"{rel}/model.json is missing: run `python -m benchmarks.transport.gpu_pack prepare` first")
    count = len(json.loads((folder / "model.json").read_text())["pieces"])
    calls = [Call(f"python3 -m {module} check {i}", (f"{rel}/model.part{i}", f"{rel}/model.json"), CHECK_S[1],
                  CHECK_S[0], f"piece {i} of {count} arrives; pieces 1..{i} are checked, the machine's versions "
                  "printed") for i in range(1, count)]
    return calls, f"{rel}/model.part{count}"


def head_plan(folder: Path) -> Plan:
    """The head's training: the model's pieces, then one call that trains and exports a head every minute."""
    from benchmarks.transport.gpu_train import CALL_S, CORPUS, FINISH_S, WITHIN_S

    rel = relative(folder)
    calls, last = piece_calls(folder, PACK)
    train = (f"set -o pipefail; {SITE} {rel}/whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 "
             f"python3 -m {PACK} train --out $OUT 2>&1 | tee $OUT/train.log")
    calls.append(Call(train, (last, f"{rel}/model.json", f"{rel}/{CORPUS}", f"{rel}/whl"), CALL_S, CALL_S - 20,
                      f"the last piece; join, pull, train in bf16 for what is left of {WITHIN_S} s less {FINISH_S} s "
                      "(about 6 min), a head exported into $OUT every minute and at the end"))
    return Plan(calls, HEAD_LIMIT_S, ["then give_back(); here, with the files of the train call (its files_at):",
                                      f"  python -m {PACK} import FILES_AT --ship {SHIP_TO}"])


def device_seconds(plan: Plan) -> tuple[int, int]:
    """The plan's device time, the start included: as expected, and with every call at its timeout."""
    expected = START_S + sum(c.expected_s + TRANSFER_S for c in plan.calls)
    worst = START_S + sum(c.timeout_s + TRANSFER_S for c in plan.calls)
    return expected, worst


def plan_text(plan: Plan) -> str:
    """The runbook: every call's size now and under the assumed final tree ("OVER 64 MiB" if it passes), its
    time, and the plan's device time against its limit ("OVER" if the worst case passes it)."""
    tree = tree_bytes()
    lines = [f"tree that travels now: {tree / 1e6:.1f} MB (the plan assumes at most {ASSUMED_TREE / 1e6:.0f} MB); "
             f"one call carries at most {CALL_LIMIT / 1e6:.1f} MB",
             "issue these run calls back to back (a machine goes back 30 s after a call, with the pieces):"]
    for n, call in enumerate(plan.calls, 1):
        carried = sum(path_bytes(ROOT / p) for p in call.carry)
        size, worst = tree + carried, max(tree, ASSUMED_TREE) + carried
        flag = "OVER 64 MiB" if worst > CALL_LIMIT else "ok"
        lines += [f"call {n}: {call.why}",
                  f"  run(command={call.command!r},",
                  f"      carry={json.dumps(list(call.carry))}, timeout_s={call.timeout_s})",
                  f"  carries {carried / 1e6:.1f} MB: {size / 1e6:.1f} MB with today's tree, "
                  f"{worst / 1e6:.1f} MB with a {max(tree, ASSUMED_TREE) / 1e6:.0f} MB tree: {flag}; "
                  f"runs about {call.expected_s} s, at most {call.timeout_s} s"]
    expected, worst = device_seconds(plan)
    flag = f"OVER {plan.limit_s / 60:g} min" if worst > plan.limit_s else "ok"
    lines += [f"device time: the start {START_S} s + each call's run and {TRANSFER_S} s of transfer: about "
              f"{expected / 60:.1f} min, at most {worst / 60:.1f} min (every call at its timeout) of "
              f"{plan.limit_s / 60:g}: {flag}", *plan.after]
    return "\n".join(lines)
