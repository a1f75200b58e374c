"""The whole ``graft bench`` command: options in, its phases in turn (prepare, run the questions, report),
outputs and exit code out."""

from __future__ import annotations

import sys
import time

from rich.console import Console

from graft_cli.bench.options import BenchOptions
from graft_cli.bench.prepare import prepare
from graft_cli.bench.progress import run_questions
from graft_cli.bench.report import report


def run_bench(opts: BenchOptions, console: Console | None = None, err_console: Console | None = None) -> int:
    """The whole ``graft bench``: returns the exit code (1 when a method was not lossless)."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    err = err_console or Console(stderr=True)
    started = time.time()
    prep = prepare(opts, err)
    outcome = run_questions(prep, err)
    return report(prep, outcome, started, console, err)
