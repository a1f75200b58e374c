"""``graft bench``: every method side by side on Spec-Bench-style questions (see graft_cli/bench/)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.cli.options import (
    Budget, Datastore, Device, DeviceMap, Draft, Dtype, Forward, Graphs, MaxNewTokens, Model, RetrieverOpt, Truncate,
    option_pairs,
)
from graft_cli.core import GraftError
from graft_cli.core.threads import use_threads

if TYPE_CHECKING:
    from graft_cli.bench.options import Shard
    from graft_cli.bench.plan import Variant


def bench(
    ctx: typer.Context,
    model: Model = DEFAULT_MODEL,
    draft: Draft = None,
    dataset: str = typer.Option("spec-bench", "--dataset", "-d", help="spec-bench, mt-bench, or a JSONL file with 'turns' or 'prompt' per line."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated categories (default: all)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="First N questions of each category."),
    max_new_tokens: MaxNewTokens = 128,
    methods: str = typer.Option("all", "--methods", help="Comma-separated: ar, pld, ... (engine methods), hf, hf-pld, hf-assisted; 'all' runs every one that can run here. ar is always run (the baseline)."),
    budget: Budget = None,
    budgets: Optional[str] = typer.Option(None, "--budgets", help="Several budgets, e.g. 4,8,16,32,auto: each engine method runs at each (for the Pareto plot)."),
    datastore: Datastore = None,
    retriever_opt: RetrieverOpt = [],
    method_opt: list[str] = typer.Option([], "--method-opt", help="FIELD=VALUE for every engine method but ar: any MethodConfig setting, e.g. depth=4, chain=true, prune_at=... (repeatable)."),
    variant: list[str] = typer.Option([], "--variant", help="'NAME=METHOD FIELD=VALUE ...': an engine method with settings of its own, run as NAME when --methods lists it, e.g. 'deep=graft depth=14 prune_at=floor:0.3'; draft=KIND:SPEC gives it a drafter of its own (repeatable)."),
    device: Device = "auto",
    dtype: Dtype = "auto",
    device_map: DeviceMap = None,
    truncate: Truncate = None,
    graphs: Graphs = "auto",
    forward: Forward = "auto",
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads for torch (default: torch's choice)."),
    out: Path = typer.Option(Path("bench-results"), "--out", "-o", help="Directory for results.json, answers/, runs.jsonl and plots."),
    shard: Optional[str] = typer.Option(None, "--shard", help="K/N: run only questions K, K+N, K+2N, ... (from 0), writing OUT/runs.K-of-N.jsonl; run the N shards side by side (one per core or GPU), then --report-only merges them."),
    resume: bool = typer.Option(False, "--resume", help="Keep the finished runs in OUT/runs.jsonl that match this configuration; run the rest."),
    report_only: bool = typer.Option(False, "--report-only", help="Run nothing: write the table, results.json, answers and plots from OUT/runs.jsonl (the runs matching this configuration)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="N passes over the questions, every method rebuilt before each (nothing it learnt carries over), the order rotating each pass; each turn's figures come from its fastest pass (a shared machine only ever adds time). The passes must give the same tokens."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One short untimed generation per method first."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots."),
) -> None:
    """Benchmark every method side by side: speedup and tau per category, lossless check, Spec-Bench answer files."""
    from graft_cli.bench.command import run_bench
    from graft_cli.bench.options import BenchOptions
    from graft_cli.method.config import retriever_settings
    from graft_cli.runtime.limits import parse_truncate
    from graft_cli.runtime.loading import parse_device_map

    opts = BenchOptions(
        model=model, draft=draft, dataset=dataset, categories=_split(categories) or None, limit=limit,
        max_new_tokens=max_new_tokens, methods=_split(methods) or ["all"], budgets=_budgets(budget, budgets),
        options=dict(retriever_settings(option_pairs(retriever_opt), datastore)),
        method_opts=_pairs(method_opt, "--method-opt"), variants=dict(_variant(text) for text in variant),
        device=device, dtype=dtype, out=out, shard=_shard(shard), resume=resume, report_only=report_only,
        warmup=warmup, plots=plots, command=_command_line(ctx), device_map=parse_device_map(device_map),
        truncate=parse_truncate(truncate), repeats=repeats, graphs=graphs, forward=forward,
    )
    if threads is not None:
        use_threads(threads)
    code = run_bench(opts)
    if code:
        raise SystemExit(code)  # after the results are written; typer.Exit would be swallowed by cli.main


def _budgets(budget: str | None, budgets: str | None) -> list:
    """``--budget`` or ``--budgets`` (each budget once, in order): the budgets every engine method runs at."""
    from graft_cli.method.config import parse_budget

    if budget is not None and budgets is not None:
        raise GraftError("give either --budget or --budgets, not both")
    if budget is not None:
        return [parse_budget(budget)]
    budget_list = [parse_budget(b) for b in _split(budgets)] if budgets is not None else []
    if budgets is not None and not budget_list:
        raise GraftError("--budgets is empty")
    return list(dict.fromkeys(budget_list))


def _pairs(pairs: list[str], flag: str) -> dict[str, str]:
    """``FIELD=VALUE`` words as a dict, dashes in a field read as underscores (``draft-top-k``)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise GraftError(f"{flag} expects FIELD=VALUE, got '{pair}'")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _variant(text: str) -> tuple[str, Variant]:
    """``NAME=METHOD FIELD=VALUE ...`` -> (NAME, Variant)."""
    from graft_cli.bench.plan import Variant

    head, *fields = text.split() or [""]
    name, sep, method = head.partition("=")
    if not sep or not name.strip() or not method.strip():
        raise GraftError(f"--variant expects 'NAME=METHOD FIELD=VALUE ...', got '{text}'")
    return name.strip(), Variant(method.strip(), _pairs(fields, f"--variant {name.strip()}"))


def _shard(text: str | None) -> Shard | None:
    """``--shard K/N``; a one-line error for anything but 0 <= K < N."""
    from graft_cli.bench.options import Shard

    if text is None:
        return None
    k, sep, n = text.partition("/")
    try:
        shard = Shard(int(k), int(n))
    except ValueError:
        shard = None
    if not sep or shard is None or not 0 <= shard.k < shard.n:
        raise GraftError(f"--shard expects K/N with 0 <= K < N, e.g. 0/2, got '{text}'")
    return shard


def _split(text: str | None) -> list[str]:
    """A comma-separated option as its non-empty parts."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _command_line(ctx: typer.Context) -> str:
    """The command as it would be typed again, every option explicit (from the parsed parameters)."""
    parts = ["graft", "bench"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or not param.opts:
            continue
        flag = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            if param.secondary_opts:
                parts.append(flag if value else max(param.secondary_opts, key=len))
            elif value:
                parts.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                parts += [flag, str(v)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)
