"""The question phase in front of the user: the warm-up, a progress bar with a line per finished run, and on an
interruption (Ctrl-C) the runs that finished, read back from the runs files so that the report still comes."""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from graft_cli.bench.execution import execute, warm_up
from graft_cli.bench.prepare import Prepared
from graft_cli.bench.runners import Runner, shared_models
from graft_cli.bench.runs import RunKey, by_question, question_key, read_runs


@dataclass
class Outcome:
    records: list[dict]  # one per (question, method) of the methods that did not fail
    names: list[str]  # those methods, in column order
    failed: dict[str, str]  # a failed method's error, by name
    interrupted: KeyboardInterrupt | None  # re-raised once the report is written
    run_s: float  # seconds the question phase took


def run_questions(prep: Prepared, err: Console) -> Outcome:
    """Every run not done yet (none with --report-only), then every runner closed (retrievers that keep state
    on disk, when asked to, save it) whatever happened."""
    _warm_up(prep, err)
    failed: dict[str, str] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=err, transient=False)
    t_run = perf_counter()
    interrupted = None
    with progress:
        task = progress.add_task("bench", total=prep.runs.total, completed=len(prep.runs.done))

        def on_record(record: dict) -> None:
            progress.console.print(record_line(record), highlight=False)
            progress.advance(task)

        try:
            records = _run_or_recall(prep, on_record, failed)
        except KeyboardInterrupt as e:
            interrupted = e
            records = _finished(prep)
        finally:
            for runner in prep.columns.runners:
                runner.close()
    run_s = perf_counter() - t_run
    for name, error in failed.items():
        err.print(f"graft: error: method {name} failed and was dropped: {error}", highlight=False)
    names = [n for n in prep.columns.names if n not in failed]
    records = [r for r in records if r["method"] in names]
    return Outcome(records=records, names=names, failed=failed, interrupted=interrupted, run_s=run_s)


def _warm_up(prep: Prepared, err: Console) -> None:
    """Warm up the methods that have a (question, pass) left to run: a resumed method that is done runs no more."""
    if prep.opts.report_only:
        return
    todo = [r for r in prep.columns.runners if _missing(prep, r)]
    if prep.opts.warmup and todo:
        err.print(f"graft bench: warming up {len(todo)} methods")
        warm_up(todo, prep.conv)


def _missing(prep: Prepared, runner: Runner) -> bool:
    """Whether a method has a (question, pass) left to run."""
    return any(RunKey(question_key(q.question_id), runner.name, k) not in prep.runs.done
               for q in prep.workload.questions for k in range(prep.opts.repeats))


def _finished(prep: Prepared) -> list[dict]:
    """After an interruption: every run of this configuration that finished, this run's and the kept ones, read
    back from the runs files (the interrupted call returned nothing)."""
    return [r for r in by_question(read_runs(prep.runs.files, prep.fingerprints), prep.opts.repeats)
            if question_key(r["question_id"]) in prep.runs.wanted and r["method"] in prep.columns.names]


def _run_or_recall(prep: Prepared, on_record: Callable[[dict], None], failed: dict[str, str]) -> list[dict]:
    """--report-only: the kept runs of the columns asked; otherwise the rest of the runs, executed."""
    opts = prep.opts
    if opts.report_only:
        return [r for r in by_question(prep.runs.done, opts.repeats) if r["method"] in prep.columns.names]
    return execute(prep.workload.questions, prep.columns.runners, prep.conv, opts.max_new_tokens,
                   runs_path=prep.runs.path, done=prep.runs.done, fingerprints=prep.fingerprints, on_record=on_record,
                   stamp={"commit": prep.provenance.commit}, failed=failed, rounds=opts.repeats,
                   fresh=lambda: _fresh(prep))


def _fresh(prep: Prepared) -> None:
    """A --repeats round starts where the run started: every method rebuilt, then warmed up again."""
    with shared_models(prep.models.target, prep.models.draft):
        for runner in prep.columns.runners:
            runner.reset()
    if prep.opts.warmup:
        warm_up(prep.columns.runners, prep.conv)


def record_line(record: dict) -> str:
    """A finished run as the progress shows it: its tokens, seconds, speed, τ and CPU use (a CPU share far below
    the thread count says other work took the cores)."""
    wall = sum(t["wall_s"] for t in record["turns"])
    toks = sum(t["new_tokens"] for t in record["turns"])
    taus = [x for t in record["turns"] for x in t["accept_lengths"]]
    cpu = sum(t.get("cpu_s", 0.0) for t in record["turns"])
    return (f"  {record['question_id']!s:>5} {record['category']:<15} {record['method']:<14} {toks:>5} tok "
            f"{wall:7.2f} s {toks / wall if wall else 0:7.2f} tok/s  τ {sum(taus) / len(taus) if taus else 1:.2f}"
            f"  cpu/wall {cpu / wall if wall else 0:.1f}")
