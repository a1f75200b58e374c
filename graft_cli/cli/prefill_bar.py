"""The prefill's progress, drawn on stderr for long prompts (a 4K-token prompt takes seconds on a CPU).

Only to a terminal, and only once a prefill has run ``delay`` seconds: short prompts, pipes, logs and ``--jsonl``
runs stay clean (stdout is never touched). The bar disappears when the prefill ends.
"""

from __future__ import annotations

import sys
from time import perf_counter
from typing import Any


class PrefillBar:
    """A :data:`graft_cli.runtime.target.Progress` callback that draws a Rich bar."""

    def __init__(self, delay: float = 2.0, stream: Any = None) -> None:
        self.delay, self.stream = delay, stream if stream is not None else sys.stderr
        self.began = 0.0
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, done: int, total: int) -> None:
        if done == 0:  # a new prefill
            self.began = perf_counter()
            return
        if self.bar is None and perf_counter() - self.began >= self.delay and done < total and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                                TimeRemainingColumn(), console=Console(file=self.stream), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total)
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
            if done >= total:
                self.bar.stop()
                self.bar = None
