"""The head plan's training call, there: the model put together and pulled, training for what is left of the
call's time, and the newest checkpoint exported into ``$OUT`` each time the training writes one (every minute:
``--checkpoint-minutes 1``), so a call cut off at its time limit still returns a head no more than a minute old.

An export replaces the one before whole or not at all (gpu_pieces.export_head), and the call's files stay at most
four (two head pieces, ``head.json``, ``train.log``) under ``$OUT``'s eight.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from graft_cli.core import GraftError

from benchmarks.transport import gpu_pieces as pieces
from benchmarks.transport.gpu_machine import environ, environment, install_model, shown

CORPUS = "corpus.npz"
CALL_S = 480  # the training call's timeout_s: the plan's start and piece calls leave this of 13 minutes
WITHIN_S = CALL_S - 15  # from the Python command's start: the wheels' install runs before it
FINISH_S = 45  # kept at the end: the last held-out evaluation and checkpoint, the export, the exit
POLL_S = 5.0  # how often the run directory is looked at for a new checkpoint
# A step is 16 sequences of 1,024 tokens (16K): about 4 TFLOP of target forward and 7 of head (7 TTT steps of its
# 8.8 M weights forward and backward, and their attention), 14 ms at an H100's 790 TFLOP/s, and as long again to
# move the fp32 draft-vocabulary logits: some 200-500K tokens a second, so the time budget, not --max-steps, ends
# the run (--max-steps only caps it). Memory: 1.2 GB plus 1.45 GB a sequence, measured on this CPU in bf16 (25 GB).
# Held-out: 1 document in 100 (about 70K tokens), 64 sequences of it (about all) at each checkpoint, every minute.
TRAIN_GPU = {"--device": "cuda", "--seq-len": "1024", "--batch-size": "16", "--lr": "3e-4", "--warmup": "100",
             "--max-steps": "100000", "--checkpoint-every": "100000", "--checkpoint-minutes": "1",
             "--log-every": "50", "--eval-sequences": "64", "--heldout-every": "100"}
TRAIN_SMOKE = {"--device": "cpu", "--threads": "1", "--seq-len": "48", "--batch-size": "2", "--lr": "3e-3",
               "--warmup": "3", "--max-steps": "100000", "--checkpoint-every": "100000",
               "--checkpoint-minutes": "0.02", "--log-every": "20", "--eval-sequences": "2", "--heldout-every": "8",
               "--ttt": "3", "--draft-vocab": "64"}
SMOKE_HEAD_PIECE = 80 << 10  # the tiny head (125 KB) in two pieces, as the real one (19.7 MB) in 15 MiB ones


def training_minutes(within: float, spent: float) -> float:
    """The training's wall minutes: what is left of ``within`` seconds after ``spent`` (the install and the
    pull), less ``FINISH_S``."""
    left = within - spent - FINISH_S
    if left < 60:
        raise GraftError(f"{left:.0f} s are left to train after {spent:.0f} s of install and pull: too little")
    return left / 60


class Exports:
    """The newest checkpoint of ``run`` exported into ``out`` each time a new one appears."""

    def __init__(self, run: Path, out: Path, record: dict, piece: int) -> None:
        self.run, self.out, self.record, self.piece = run, out, record, piece
        self.last: str | None = None
        self.count = 0

    def poll(self, force: bool = False) -> bool:
        """Export the newest checkpoint if it is new (``force``: again, for the final record). A checkpoint
        replaced while it was read is left to the next poll; the export before it stays whole."""
        from graft_cli.heads import checkpoint as ckpt

        latest = ckpt.latest_checkpoint(self.run)
        if latest is None or (latest.name == self.last and not force):
            return False
        try:
            pieces.export_head(self.run, self.out, self.record, self.piece)
        except (OSError, ValueError, GraftError):
            return False
        self.last, self.count = latest.name, self.count + 1
        return True


def watch(process: subprocess.Popen, exports: Exports, deadline: float, clock: Callable[[], float]) -> int:
    """Export each new checkpoint while ``process`` trains; stop it at ``deadline`` (exit 124). Its exit code."""
    while True:
        try:
            rc = process.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            exports.poll()
            if clock() >= deadline:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                rc = 124
                break
    exports.poll()
    return rc


def train_there(folder: Path, out: Path, minutes: float | None, smoke: bool, within: float = WITHIN_S) -> int:
    """The training call: install the model, train for ``minutes`` of wall time (None: what ``within`` seconds
    leave), exporting each checkpoint into ``out`` as it comes and the last one with the training's exit code.
    Returns that exit code (124: stopped at the call's deadline)."""
    t0 = time.perf_counter()
    if (folder / "run").exists():  # an earlier try on this warm machine: kept, and this one starts afresh
        (folder / "run").rename(folder / f"run-{time.strftime('%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    with environ(GRAFT_HOME=str((folder / "home").resolve()), HF_HUB_OFFLINE="1"):
        model = install_model(folder)
        spent = time.perf_counter() - t0
        minutes = minutes if minutes is not None else training_minutes(within, spent)
        print(f"model {model} installed ({spent:.0f} s); training {minutes:.2f} min; {environment()}",
              file=sys.stderr)
        args = ["--model", shown(model) if smoke else model, "--data", shown(folder / CORPUS),
                "--run", shown(folder / "run"), "--out", shown(folder / "head"), "--max-minutes", f"{minutes:g}"]
        for key, value in (TRAIN_SMOKE if smoke else TRAIN_GPU).items():
            args += [key, value]
        command = "graft heads train " + " ".join(args)
        print(command, file=sys.stderr, flush=True)
        record = {"command": command, "exit": None, "device": environment()}
        exports = Exports(folder / "run", out, record, SMOKE_HEAD_PIECE if smoke else pieces.HEAD_PIECE)
        process = subprocess.Popen([sys.executable, "-m", "graft_cli", "heads", "train", *args])
        rc = watch(process, exports, t0 + max(within, spent + minutes * 60 + FINISH_S) - 5, time.perf_counter)
    record.update(exit=rc, seconds=round(time.perf_counter() - t0))
    if not exports.poll(force=True):
        raise GraftError(f"the training exited {rc} and wrote no checkpoint to export")
    manifest = pieces.exported(out)
    state = manifest["state"]
    last = state["evals"][-1] if state.get("evals") else {}
    print(f"head of step {state['step']:,} ({state['tokens']:,} tokens) exported into {out} (export {exports.count} "
          f"of the run): {len(manifest['pieces'])} pieces, {manifest['bytes']:,} bytes, sha256 "
          f"{manifest['sha256'][:16]}...; held-out top-1 per TTT step {last.get('acceptance')}; training exit {rc}",
          file=sys.stderr)
    return rc
