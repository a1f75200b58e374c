"""The progress of `graft index build`: datastores.shard_writer.Progress drawn with Rich on stderr, one bar a stage."""

from __future__ import annotations

import time


def short_count(n: int) -> str:
    """A token count, short: 1.23M."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return str(n)


class BuildProgress:
    """datastores.shard_writer.Progress drawn with Rich on stderr."""

    LABELS = {"files": "files", "tokens": "tokens", "sort": "suffix sort", "index": "n-gram index", "write": "manifest"}

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description:<13}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.enabled,
            transient=False,
        )

    def __enter__(self) -> "BuildProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def start(self, stage: str, total: float | None = None) -> None:
        self.started.setdefault(stage, time.perf_counter())
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(self.LABELS.get(stage, stage), total=total, rate="")
            self.done[stage] = 0

    def advance(self, stage: str, amount: float = 1, total: float | None = None) -> None:
        if stage not in self.tasks:
            self.start(stage, total)
        self.done[stage] += amount
        dt = time.perf_counter() - self.started[stage]
        rate = f"{short_count(int(self.done[stage] / dt))}/s" if stage == "tokens" and dt > 0 else ""
        kwargs = {"total": total} if total is not None else {}
        self.progress.update(self.tasks[stage], advance=amount, rate=rate, **kwargs)

    def finish(self, stage: str) -> None:
        if stage in self.tasks:
            n = max(self.done[stage], 1)
            self.progress.update(self.tasks[stage], total=n, completed=n)

    def note(self, message: str) -> None:
        self.console.print(f"graft: {message}", markup=False, highlight=False)
