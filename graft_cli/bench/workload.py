"""What a run will do, settled before any model loads: its questions (this shard's) and its columns, every option
checked on the way so that a mistake costs a line of error rather than a model load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graft_cli.bench.datasets import Question, categories_of, load_questions, resolve_dataset
from graft_cli.bench.options import BenchOptions
from graft_cli.bench.plan import MethodSpec, expand_methods, plan_methods
from graft_cli.bench.runs import runs_files
from graft_cli.core import GraftError
from graft_cli.method.config import METHODS, parse_draft


@dataclass
class Workload:
    dataset: Path
    questions: list[Question]  # this shard's
    categories: list[str]  # of the whole dataset as asked: a shard reports the same groups as the merged run
    specs: list[MethodSpec]  # the columns asked; those that cannot be built here drop out when loading
    explicit: bool  # the methods were named (not ``all``): one that cannot be built fails the run
    draft_kind: str | None  # --draft KIND:SPEC read; None without --draft
    draft_spec: str | None


def plan_workload(opts: BenchOptions) -> Workload:
    """The questions and columns of ``opts``, checked in the order a user meets the options' mistakes."""
    _check_options(opts)
    path = resolve_dataset(opts.dataset)
    questions = load_questions(path, opts.categories, opts.limit)
    categories = categories_of(questions)
    if opts.shard:
        if opts.report_only:
            raise GraftError("--report-only merges every shard: give it without --shard")
        questions = questions[opts.shard.k::opts.shard.n]
        if not questions:
            raise GraftError(f"--shard {opts.shard}: no questions in this shard")
    asked = expand_methods(opts.methods, METHODS, opts.draft)
    specs = plan_methods(asked.names, METHODS, opts.budgets, opts.variants)
    if any(s.method == "hf-assisted" for s in specs) and not opts.draft:
        raise GraftError("hf-assisted needs a draft model: give --draft MODEL")
    kind, draft_spec = parse_draft(opts.draft) if opts.draft else (None, None)  # a bad KIND: before any load
    return Workload(dataset=path, questions=questions, categories=categories, specs=specs, explicit=asked.explicit,
                    draft_kind=kind, draft_spec=draft_spec)


def _check_options(opts: BenchOptions) -> None:
    """The mistakes that need no dataset to be seen."""
    if opts.report_only and not any(p.is_file() for p in runs_files(Path(opts.out))):
        raise GraftError(f"--report-only: no {runs_files(Path(opts.out))[0]} to report from")
    if opts.repeats > 1 and opts.options.get("adjacency_file"):
        raise GraftError("--repeats rebuilds every method before each pass; a Token Recycling table kept in "
                         "adjacency_file would carry one pass's answers into the next: drop one of them")
