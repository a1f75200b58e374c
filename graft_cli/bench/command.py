"""The whole ``graft bench`` command: options in, every part of graft_cli/bench/ in turn, outputs and exit
code out."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

from graft_cli.runtime import token_ranking
from graft_cli.bench.datasets import REPO_ROOT, categories_of, load_questions, resolve_dataset
from graft_cli.bench.execution import (Conversation, by_question, check_reach, execute, read_runs, record_key, runs_files,
                                      warm_up)
from graft_cli.bench.plan import MethodSpec, Variant, expand_methods, fingerprint, method_config, plan_methods, uses_draft
from graft_cli.bench.results import (RESULTS_SCHEMA, environment, lean_record, lossless_line, per_question_seconds,
                                     summarize, table, write_answers, write_results)
from graft_cli.bench.runners import HF_PLD_TOKENS, build_runners, shared_models
from graft_cli.core import defaults_for, GraftError
from graft_cli.method_config import METHODS, drafting_for, tree_reach
from graft_cli.runtime.lossless import describe, report

@dataclass
class BenchOptions:
    model: str
    draft: str | None = None
    dataset: str = "spec-bench"
    categories: list[str] | None = None
    limit: int | None = None
    max_new_tokens: int = 128
    methods: list[str] = field(default_factory=lambda: ["all"])
    budgets: list[Any] = field(default_factory=list)  # ints and/or "auto"; empty: the device default
    options: dict[str, str] = field(default_factory=dict)  # retriever options (datastore=...)
    method_opts: dict[str, str] = field(default_factory=dict)  # other MethodConfig fields, e.g. depth=4, chain=true
    variants: dict[str, Variant] = field(default_factory=dict)  # named methods with settings of their own
    device: str = "auto"
    dtype: str = "auto"
    out: Path = Path("bench-results")
    resume: bool = False
    report_only: bool = False  # write the outputs from OUT/runs*.jsonl, run nothing
    shard: tuple[int, int] | None = None  # (K, N): questions K, K+N, ... only; records to OUT/runs.K-of-N.jsonl
    warmup: bool = True
    plots: bool = True
    command: str = ""
    device_map: str | dict | None = None  # accelerate's placement of a model larger than one GPU (--device-map)
    truncate: str | None = None  # left or right: cut prompts that would reach past the model's limits
    repeats: int = 1  # passes over the questions from freshly built methods; each turn from its fastest pass


def _git_commit() -> str | None:
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_bench(opts: BenchOptions, console=None, err_console=None) -> int:
    """The whole ``graft bench``: returns the exit code (1 when a method was not lossless)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from graft_cli import methods
    from graft_cli.catalog.checksums import model_checksum
    from graft_cli.method_config import DEFAULT_KIND, parse_draft
    from graft_cli.runtime.loading import load_model, stop_ids

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    err = err_console or Console(stderr=True)
    started = time.time()
    if opts.report_only and not any(p.is_file() for p in runs_files(Path(opts.out))):  # before the dataset: not needed
        raise GraftError(f"--report-only: no {runs_files(Path(opts.out))[0]} to report from")
    if opts.repeats > 1 and opts.options.get("adjacency_file"):
        raise GraftError("--repeats rebuilds every method before each pass; a Token Recycling table kept in "
                         "adjacency_file would carry one pass's answers into the next: drop one of them")
    path = resolve_dataset(opts.dataset)
    questions = load_questions(path, opts.categories, opts.limit)
    categories = categories_of(questions)
    if opts.shard:
        if opts.report_only:
            raise GraftError("--report-only merges every shard: give it without --shard")
        questions = questions[opts.shard[0]::opts.shard[1]]
        if not questions:
            raise GraftError(f"--shard {opts.shard[0]}/{opts.shard[1]}: no questions in this shard")
    names, explicit = expand_methods(opts.methods, METHODS, opts.draft)
    specs = plan_methods(names, METHODS, opts.budgets, opts.variants)
    if any(s.method == "hf-assisted" for s in specs) and not opts.draft:
        raise GraftError("hf-assisted needs a draft model: give --draft MODEL")
    kind, draft_spec = parse_draft(opts.draft) if opts.draft else (None, None)  # a bad KIND: before any load

    err.print(f"graft bench: {len(questions)} questions ({', '.join(categories)}) from {path}")
    loaded = load_model(opts.model, opts.device, opts.dtype, opts.device_map)
    device = loaded.device
    # a sharded target's draft sits whole where the target's inputs go; other kinds load what they need themselves
    draft_device = device if opts.device_map else opts.device
    draft_loaded = load_model(draft_spec, draft_device, opts.dtype) if kind == DEFAULT_KIND else None
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    with shared_models(loaded, draft_loaded):
        runners, specs = build_runners(specs, loaded, draft_loaded, opts.options, explicit,
                                       lambda m: err.print(f"graft: {m}"), opts.method_opts, opts.draft)
    names = [s.name for s in specs]
    stop = stop_ids(loaded)
    depth = max(reach_depth(s, opts, draft_loaded, device) for s in specs)
    limits = loaded.limits
    conv = Conversation(loaded.tokenizer, stop, lambda ids: limits.fit(ids, opts.max_new_tokens, depth, opts.truncate))
    if opts.truncate is None:
        check_reach(questions, Conversation(loaded.tokenizer, stop), limits, opts.max_new_tokens, depth)

    checksum = model_checksum(loaded.path)
    draft_checksum = model_checksum(draft_loaded.path) if draft_loaded else opts.draft  # a plugin's: its spec
    ranking = token_ranking.ranking_path(loaded.tokenizer) if draft_loaded else None  # a draft's vocabulary follows it
    ranking_sha = _file_sha256(ranking) if ranking is not None and ranking.is_file() else None
    if kind == "eagle3":
        from graft_cli.heads import resolve_head

        draft_checksum = _file_sha256(resolve_head(draft_spec) / "model.safetensors")
    data_sha = _file_sha256(path)
    commit = _git_commit()
    env = environment(device)
    common = {"model": checksum, "dataset": data_sha, "max_new_tokens": opts.max_new_tokens, "device": device,
              "dtype": dtype, "threads": env["device"]["torch_threads"]}
    if opts.truncate:  # cut prompts are other prompts
        common["truncate"] = opts.truncate
    if opts.repeats > 1:  # the fastest of several rounds is another figure than one round's
        common["repeats"] = opts.repeats
    fingerprints = {}
    for s in specs:
        parts = dict(common, spec=s.as_dict())
        if uses_draft(s):
            parts.update(draft=draft_checksum)
        if s.kind == "engine" and s.method != "ar":
            parts.update(options=opts.options)
            if opts.method_opts:
                parts.update(method_opts=opts.method_opts)
            if ranking_sha and uses_draft(s):
                parts.update(token_ranking=ranking_sha)
            if draft_loaded and uses_draft(s):  # a half-weight draft is another draft; runs before it were full
                config = method_config(s, opts.options, opts.draft, opts.method_opts)
                weights = drafting_for(config, device)[0].draft_weights
                if weights != "full":
                    parts.update(draft_weights=weights)
        fingerprints[s.name] = fingerprint(parts)

    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_path = runs_files(out_dir, opts.shard)[0]
    every_run = runs_files(out_dir)
    resume = opts.resume or opts.report_only
    done = read_runs(every_run, fingerprints) if resume else {}
    if not resume:
        for p in [runs_path] if opts.shard else every_run:
            p.unlink(missing_ok=True)
    wanted = {json.dumps(q.question_id) for q in questions}
    done = {k: r for k, r in done.items() if k[0] in wanted and k[2] < opts.repeats}
    old = {r.get("commit") for r in done.values()} - {commit}
    total = len(questions) * len(runners) * opts.repeats
    if done:
        err.print(f"graft bench: resuming: {len(done)} of {total} runs already done")
        if old:
            err.print(f"graft: warning: resumed runs come from other code versions ({', '.join(map(str, old))})")
    todo = [r for r in runners
            if any((json.dumps(q.question_id), r.name, k) not in done for q in questions for k in range(opts.repeats))]
    if opts.report_only:
        todo = []
    if opts.warmup and todo:
        err.print(f"graft bench: warming up {len(todo)} methods")
        warm_up(todo, conv)

    failed: dict[str, str] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=err, transient=False)

    def on_record(record: dict) -> None:
        wall = sum(t["wall_s"] for t in record["turns"])
        toks = sum(t["new_tokens"] for t in record["turns"])
        taus = [x for t in record["turns"] for x in t["accept_lengths"]]
        cpu = sum(t.get("cpu_s", 0.0) for t in record["turns"])
        progress.console.print(
            f"  {record['question_id']!s:>5} {record['category']:<15} {record['method']:<14} {toks:>5} tok "
            f"{wall:7.2f} s {toks / wall if wall else 0:7.2f} tok/s  τ {sum(taus) / len(taus) if taus else 1:.2f}"
            f"  cpu/wall {cpu / wall if wall else 0:.1f}",
            highlight=False,
        )
        progress.advance(task)

    def fresh() -> None:
        """A --repeats round starts where the run started: every method rebuilt, then warmed up again."""
        with shared_models(loaded, draft_loaded):
            for runner in runners:
                runner.reset()
        if opts.warmup:
            warm_up(runners, conv)

    t_run = perf_counter()
    interrupted = None
    with progress:
        task = progress.add_task("bench", total=total, completed=len(done))
        try:
            if opts.report_only:
                records = [r for r in by_question(done, opts.repeats) if r["method"] in names]
            else:
                records = execute(questions, runners, conv, opts.max_new_tokens, runs_path, done, fingerprints,
                                  on_record, {"commit": commit}, failed, opts.repeats, fresh)
        except KeyboardInterrupt as e:
            interrupted = e
            records = [r for r in by_question(read_runs(every_run, fingerprints), opts.repeats)
                       if record_key(r)[0] in wanted and r["method"] in names]
        finally:
            for runner in runners:  # retrievers that keep state on disk (when asked to) save it
                runner.close()
    run_s = perf_counter() - t_run
    for name, error in failed.items():
        err.print(f"graft: error: method {name} failed and was dropped: {error}", highlight=False)
    names = [n for n in names if n not in failed]
    records = [r for r in records if r["method"] in names]

    disagree = [{"question_id": r["question_id"], "method": r["method"]} for r in records
                if r.get("rounds_agree") is False]
    summary = summarize(records, names, categories)
    lossless = report(records, dtype)
    mismatches = lossless["mismatches"]
    model_id = Path(str(opts.model)).name
    config = {
        "command": opts.command,
        "argv": sys.argv,
        "model": {"spec": opts.model, "path": str(loaded.path), "checksum": checksum},
        "draft": {"spec": opts.draft, "path": str(draft_loaded.path), "checksum": draft_checksum} if draft_loaded else None,
        "dataset": {"spec": opts.dataset, "path": str(path), "sha256": data_sha},
        "categories": categories,
        "limit": opts.limit,
        "questions": len(questions),
        "max_new_tokens": opts.max_new_tokens,
        "methods": [s.as_dict() for s in specs],
        "budgets": opts.budgets,
        "default_budget": defaults_for(device).budget,
        "options": opts.options,
        "method_opts": opts.method_opts,
        "variants": {name: {"method": v.method, **v.opts} for name, v in opts.variants.items()},
        "dtype": dtype,
        "device_map": opts.device_map,
        "truncate": opts.truncate,
        "sampling": "greedy",
        "warmup": opts.warmup,
        "interleaving": "question by question, method order rotating by one per question"
                        + (f"; {opts.repeats} passes over the questions, each from freshly built methods, the order "
                           "rotating by one more and reversed every other pass; each turn from its fastest pass"
                           if opts.repeats > 1 else ""),
        "repeats": opts.repeats,
        "commit": commit,
        **env,
    }
    n_done = sum(len(r["turns"]) for r in records)
    timing = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "total_s": round(time.time() - started, 1),
        "run_s": round(run_s, 1),
        "turns": n_done,
        "method_s_per_question": per_question_seconds(records, names),
        "wall_s_per_question_all_methods": round(
            sum(sum(t["wall_s"] for t in r["turns"]) for r in records) / max(1, len({record_key(r)[0] for r in records})), 2),
    }
    results = {
        "schema": RESULTS_SCHEMA,
        "config": config,
        "summary": summary,
        "lossless": lossless,
        "failed": failed,
        "rounds_disagree": disagree,
        "timing": timing,
        "prompts": [lean_record(r) for r in records],
        "complete": interrupted is None and not failed and len(records) * opts.repeats == total,
        "report_only": opts.report_only,
    }
    if opts.shard:  # the merged outputs come from --report-only once every shard has finished
        write_results(out_dir / f"results.{opts.shard[0]}-of-{opts.shard[1]}.json", results)
    else:
        write_results(out_dir / "results.json", results)
        write_answers(out_dir, records, names, questions, model_id)
        if opts.plots and summary.get("overall"):
            from graft_cli import plots

            plots.write_all(out_dir, results)
    n_questions = summary.get("overall", {}).get("ar", {}).get("questions", 0)
    title = f"{model_id} on {opts.dataset}: {n_questions} questions, {opts.max_new_tokens} new tokens, {device}"
    console.print(table(summary, names, title))
    if summary.get("overall", {}).get("ar", {}).get("decode_tokens_per_s"):  # the prefill excluded
        console.print(table(summary, names, f"decoding alone (after the first tokens): {title}", decoding=True))
    if summary.get("overall", {}).get("ar", {}).get("pass_tokens_per_s"):  # --repeats: the passes one by one
        console.print(table(summary, names, f"each pass on its own ({opts.repeats} passes): {title}", passes=True))
    console.print(lossless_line(lossless), highlight=False)
    if opts.shard:
        err.print(f"graft bench: shard {opts.shard[0]}/{opts.shard[1]} in {out_dir}/{runs_path.name}; once every "
                  f"shard has finished, the same command with --report-only instead of --shard merges them")
    else:
        err.print(f"graft bench: results in {out_dir}/ (results.json, answers/, runs.jsonl"
                  f"{', plots' if opts.plots else ''})")
    if interrupted is not None:
        raise interrupted
    for d in disagree:
        err.print(f"graft: warning: question {d['question_id']}, {d['method']}: its --repeats rounds produced "
                  "different tokens; its first round is reported", highlight=False)
    for d in lossless["ties"]:
        err.print(f"graft: note: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    for d in mismatches:
        err.print(f"graft: error: {describe(d, lossless['tie_tolerance'])}", highlight=False)
    return 1 if mismatches or failed else 0


def reach_depth(spec: MethodSpec, opts: BenchOptions, draft_loaded, device: str) -> int:
    """How far past the prompt and its answer a method's last forward reaches: its deepest tree, or the tokens a
    transformers peer looks ahead."""

    if spec.kind == "engine":
        return tree_reach(method_config(spec, opts.options, opts.draft, opts.method_opts), device)
    if spec.method == "hf-assisted" and draft_loaded is not None:
        return int(getattr(draft_loaded.model.generation_config, "num_assistant_tokens", 20) or 20)
    return HF_PLD_TOKENS if spec.method == "hf-pld" else 0
