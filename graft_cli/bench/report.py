"""The report phase: the lossless check, results.json (a shard's own file until ``--report-only`` merges them),
the answer files and plots, the tables, and the exit code (1 when a method was not lossless or failed)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from graft_cli.bench import plots
from graft_cli.bench.answers import write_answers
from graft_cli.bench.prepare import Prepared
from graft_cli.bench.progress import Outcome
from graft_cli.bench.results import RESULTS_SCHEMA, lean_record, per_question_seconds, summarize, write_results
from graft_cli.bench.runs import question_key
from graft_cli.bench.tables import lossless_line, table
from graft_cli.core import defaults_for
from graft_cli.runtime.fixed_target import use_graphs
from graft_cli.runtime.lossless import describe
from graft_cli.runtime.lossless import report as lossless_report


def report(prep: Prepared, outcome: Outcome, started: float, console: Console, err: Console) -> int:
    """Everything written before an interruption is raised again, so that a stopped run still reports what
    finished; the notes on ties and mismatches come last, under the tables."""
    records, names = outcome.records, outcome.names
    disagree = [{"question_id": r["question_id"], "method": r["method"]} for r in records
                if r.get("rounds_agree") is False]
    summary = summarize(records, names, prep.workload.categories)
    lossless = lossless_report(records, prep.models.dtype)
    results = {
        "schema": RESULTS_SCHEMA,
        "config": run_config(prep),
        "summary": summary,
        "lossless": lossless,
        "failed": outcome.failed,
        "rounds_disagree": disagree,
        "timing": run_timing(outcome, started),
        "prompts": [lean_record(r) for r in records],
        "complete": (outcome.interrupted is None and not outcome.failed
                     and len(records) * prep.opts.repeats == prep.runs.total),
        "report_only": prep.opts.report_only,
    }
    _write(prep, outcome, results)
    _print_tables(prep, summary, names, lossless, console)
    _print_where(prep, err)
    if outcome.interrupted is not None:
        raise outcome.interrupted
    for d in disagree:
        err.print(f"graft: warning: question {d['question_id']}, {d['method']}: its --repeats rounds produced "
                  "different tokens; its first round is reported", highlight=False)
    for d in lossless["ties"]:
        err.print(f"graft: note: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    for d in lossless["mismatches"]:
        err.print(f"graft: error: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    return 1 if lossless["mismatches"] or outcome.failed else 0


def run_config(prep: Prepared) -> dict:
    """results.json's ``config``: what was asked, what it resolved to, and where the figures come from."""
    opts, models, provenance = prep.opts, prep.models, prep.provenance
    draft = (None if models.draft is None else
             {"spec": opts.draft, "path": str(models.draft.path), "checksum": provenance.draft_checksum})
    return {
        "command": opts.command,
        "argv": sys.argv,
        "model": {"spec": opts.model, "path": str(models.target.path), "checksum": provenance.model_checksum},
        "draft": draft,
        "dataset": {"spec": opts.dataset, "path": str(prep.workload.dataset), "sha256": provenance.dataset_sha},
        "categories": prep.workload.categories,
        "limit": opts.limit,
        "questions": len(prep.workload.questions),
        "max_new_tokens": opts.max_new_tokens,
        "methods": [s.as_dict() for s in prep.columns.specs],
        "budgets": opts.budgets,
        "default_budget": defaults_for(models.device).budget,
        "options": opts.options,
        "method_opts": opts.method_opts,
        "variants": {name: {"method": v.method, **v.opts} for name, v in opts.variants.items()},
        "dtype": models.dtype,
        "device_map": opts.device_map,
        "truncate": opts.truncate,
        "graphs": use_graphs(opts.graphs, models.device),
        "forward": models.forward,
        "sampling": "greedy",
        "warmup": opts.warmup,
        "interleaving": "question by question, method order rotating by one per question"
                        + (f"; {opts.repeats} passes over the questions, each from freshly built methods, the order "
                           "rotating by one more and reversed every other pass; each turn from its fastest pass"
                           if opts.repeats > 1 else ""),
        "repeats": opts.repeats,
        "commit": provenance.commit,
        **provenance.environment,
    }


def run_timing(outcome: Outcome, started: float) -> dict:
    """results.json's ``timing``: how long the run took, and per question what sizing a longer one needs."""
    records = outcome.records
    questions = len({question_key(r["question_id"]) for r in records})
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "total_s": round(time.time() - started, 1),
        "run_s": round(outcome.run_s, 1),
        "turns": sum(len(r["turns"]) for r in records),
        "method_s_per_question": per_question_seconds(records, outcome.names),
        "wall_s_per_question_all_methods": round(
            sum(sum(t["wall_s"] for t in r["turns"]) for r in records) / max(1, questions), 2),
    }


def _model_id(prep: Prepared) -> str:
    return Path(str(prep.opts.model)).name


def _write(prep: Prepared, outcome: Outcome, results: dict) -> None:
    """A shard writes its own results file only: the merged outputs come from --report-only once every shard has
    finished."""
    opts, out_dir = prep.opts, prep.runs.out_dir
    if opts.shard:
        write_results(out_dir / f"results.{opts.shard.tag}.json", results)
        return
    write_results(out_dir / "results.json", results)
    write_answers(out_dir, outcome.records, outcome.names, prep.workload.questions, _model_id(prep))
    if opts.plots and results["summary"].get("overall"):
        plots.write_all(out_dir, results)


def _print_tables(prep: Prepared, summary: dict, names: list[str], lossless: dict, console: Console) -> None:
    """The speedup table; the decoding-alone table when first-token times were measured; the per-pass table
    with --repeats; the lossless line."""
    opts = prep.opts
    ar = summary.get("overall", {}).get("ar", {})
    title = (f"{_model_id(prep)} on {opts.dataset}: {ar.get('questions', 0)} questions, {opts.max_new_tokens} new "
             f"tokens, {prep.models.device}")
    console.print(table(summary, names, title))
    if ar.get("decode_tokens_per_s"):  # the prefill excluded
        console.print(table(summary, names, f"decoding alone (after the first tokens): {title}", decoding=True))
    if ar.get("pass_tokens_per_s"):  # --repeats: the passes one by one
        console.print(table(summary, names, f"each pass on its own ({opts.repeats} passes): {title}", passes=True))
    console.print(lossless_line(lossless), highlight=False)


def _print_where(prep: Prepared, err: Console) -> None:
    opts, out_dir = prep.opts, prep.runs.out_dir
    if opts.shard:
        err.print(f"graft bench: shard {opts.shard} in {out_dir}/{prep.runs.path.name}; once every "
                  f"shard has finished, the same command with --report-only instead of --shard merges them")
    else:
        err.print(f"graft bench: results in {out_dir}/ (results.json, answers/, runs.jsonl"
                  f"{', plots' if opts.plots else ''})")
