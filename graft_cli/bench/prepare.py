"""Everything a run settles before its first timed forward: the workload, the models and columns, where the
figures come from, each column's fingerprint and what earlier runs of the same configuration already did."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from graft_cli.bench.execution import Conversation
from graft_cli.bench.fingerprints import fingerprints
from graft_cli.bench.models import Models, build_columns, conversation, load_models
from graft_cli.bench.options import BenchOptions
from graft_cli.bench.provenance import Provenance, gather
from graft_cli.bench.runners import Columns
from graft_cli.bench.runs import RunsState, open_runs
from graft_cli.bench.workload import Workload, plan_workload


@dataclass
class Prepared:
    """A run ready to go: what the question phase runs and the report phase reports."""

    opts: BenchOptions
    workload: Workload
    models: Models
    columns: Columns
    conv: Conversation
    provenance: Provenance
    fingerprints: dict[str, str]
    runs: RunsState


def prepare(opts: BenchOptions, err: Console) -> Prepared:
    """The phases cheapest first: a mistaken option fails before a model loads, a prompt too long for the model
    before any checksum is computed, and nothing is removed from ``--out`` until all of them passed."""
    workload = plan_workload(opts)
    err.print(f"graft bench: {len(workload.questions)} questions ({', '.join(workload.categories)}) from "
              f"{workload.dataset}")
    models = load_models(opts, workload)
    columns = build_columns(opts, workload, models, lambda m: err.print(f"graft: {m}"))
    conv = conversation(opts, workload, models, columns.specs)
    provenance = gather(opts, workload, models)
    prints = fingerprints(opts, columns.specs, models, provenance)
    runs = open_runs(opts, workload.questions, prints, provenance.commit, len(columns.runners), err)
    return Prepared(opts=opts, workload=workload, models=models, columns=columns, conv=conv, provenance=provenance,
                    fingerprints=prints, runs=runs)
