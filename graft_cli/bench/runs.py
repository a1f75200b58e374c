"""The runs files: every finished (question, method, pass) appended as one JSON line at once, so that an interrupted
run resumes (``--resume``), shards merge (``--report-only``) and a changed configuration is told apart by its
fingerprint (graft_cli/bench/fingerprints.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, Sequence

from rich.console import Console

from graft_cli.bench.datasets import Question
from graft_cli.bench.options import BenchOptions, Shard


class RunKey(NamedTuple):
    """What one runs-file line is the run of; a later line of the same key replaces an earlier one."""

    question: str  # the question id as JSON (:func:`question_key`)
    method: str
    round: int  # the --repeats pass, 0 for a one-pass run


def question_key(question_id: Any) -> str:
    """A question id as the runs files compare it: as JSON, so that 1 and "1" stay two questions."""
    return json.dumps(question_id)


def run_key(record: dict) -> RunKey:
    """A runs-file line's key: a record of a one-round run is its round 0."""
    return RunKey(question_key(record["question_id"]), record["method"], int(record.get("round", 0)))


def fastest(rounds: Sequence[dict]) -> dict:
    """One record from a question's rounds of one method: each turn's figures from the round that ran it
    fastest (other work on a shared machine only ever adds time, as the latency profile assumes), with every
    round's wall time beside them. Rounds whose tokens differ are not mixed: the first round is kept whole and
    ``rounds_agree`` says so (a lossless method always agrees)."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    agree = all([t["tokens"] for t in r["turns"]] == [t["tokens"] for t in first["turns"]] for r in rounds)
    turns = []
    for i, turn in enumerate(first["turns"]):
        ran = [r["turns"][i] for r in rounds] if agree else [turn]
        turns.append({**min(ran, key=lambda t: t["wall_s"]),
                      "round_wall_s": [r["turns"][i]["wall_s"] for r in rounds if i < len(r["turns"])]})
    merged = {k: v for k, v in first.items() if k != "round"}
    return {**merged, "turns": turns, "rounds": len(rounds), "rounds_agree": agree}


def by_question(runs: dict[RunKey, dict], rounds: int = 1) -> list[dict]:
    """One record per (question, method) whose every round finished: :func:`fastest` of them."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    # keys unpacked rather than read by name: a caller's plain (question, method, round) tuples key as well
    for (qid, method, r), record in sorted(runs.items(), key=lambda kv: kv[0][2]):
        if r < rounds:
            grouped.setdefault((qid, method), []).append(record)
    return [fastest(recs) for recs in grouped.values() if len(recs) == rounds]


def runs_files(out_dir: Path, shard: Shard | None = None) -> list[Path]:
    """Where runs are appended: ``runs.jsonl``, or ``runs.K-of-N.jsonl`` for a shard. With ``shard`` None: every
    runs file in ``out_dir`` (what --resume and --report-only merge), ``runs.jsonl`` first."""
    if shard is not None:
        return [out_dir / f"runs.{shard.tag}.jsonl"]
    return [out_dir / "runs.jsonl"] + sorted(out_dir.glob("runs.*-of-*.jsonl"))


def read_runs(paths: Path | Sequence[Path], fingerprints: dict[str, str]) -> dict[RunKey, dict]:
    """Records of earlier runs whose method fingerprint still matches (what --resume keeps), one per (question,
    method, round); a later line or file replaces an earlier record of the same key."""
    done: dict[RunKey, dict] = {}
    for path in [paths] if isinstance(paths, Path) else paths:
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
            if isinstance(record, dict) and fingerprints.get(record.get("method")) == record.get("fingerprint"):
                done[run_key(record)] = record
    return done


class RunsLog:
    """A runs file open for appending while the questions run (``path`` None: records are kept nowhere); each
    record is flushed as soon as it is written, so that an interruption loses at most the run under way."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file: IO[str] | None = None

    def __enter__(self) -> RunsLog:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
            if self.file.tell() and not self.path.read_bytes().endswith(b"\n"):  # a line cut short by an interruption
                self.file.write("\n")
        return self

    def append(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.file.flush()

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


@dataclass
class RunsState:
    """A run's runs files as it starts: where it appends, and what earlier runs of this configuration left that
    it keeps (--resume, --report-only)."""

    out_dir: Path
    path: Path  # where this run appends: runs.jsonl, or its shard's file
    files: list[Path]  # every runs file in out_dir: what an interrupted run reports from
    done: dict[RunKey, dict]  # kept runs of the questions and passes asked
    wanted: set[str]  # the question keys of this run
    total: int  # runs in all: questions x methods x passes


def open_runs(opts: BenchOptions, questions: Sequence[Question], fingerprints: dict[str, str], commit: str | None,
              methods: int, err: Console) -> RunsState:
    """The runs files under ``--out``: the matching records kept when resuming (or reporting), the old files
    removed otherwise (a shard removes only its own: the others may be running)."""
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = runs_files(out_dir, opts.shard)[0]
    every = runs_files(out_dir)
    resume = opts.resume or opts.report_only
    done = read_runs(every, fingerprints) if resume else {}
    if not resume:
        for p in [path] if opts.shard else every:
            p.unlink(missing_ok=True)
    wanted = {question_key(q.question_id) for q in questions}
    done = {k: r for k, r in done.items() if k.question in wanted and k.round < opts.repeats}
    old = {r.get("commit") for r in done.values()} - {commit}
    total = len(questions) * methods * opts.repeats
    if done:
        err.print(f"graft bench: resuming: {len(done)} of {total} runs already done")
        if old:
            err.print(f"graft: warning: resumed runs come from other code versions ({', '.join(map(str, old))})")
    return RunsState(out_dir=out_dir, path=path, files=every, done=done, wanted=wanted, total=total)
