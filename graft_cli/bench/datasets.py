"""The questions a benchmark runs: the named datasets (Spec-Bench, MT-Bench) or any JSONL file of turns."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from graft_cli.core import GraftError

REPO_ROOT = Path(__file__).resolve().parents[2]
DATASETS = {"spec-bench": "spec_bench_question.jsonl", "mt-bench": "mt_bench_question.jsonl"}
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass
class Question:
    question_id: Any
    category: str
    turns: list[str]


def data_dirs() -> list[Path]:
    """Where the named datasets are looked for: $GRAFT_BENCH_DATA, then the shared data next to the repository."""
    dirs = []
    if os.environ.get("GRAFT_BENCH_DATA"):
        dirs.append(Path(os.environ["GRAFT_BENCH_DATA"]).expanduser())
    dirs += [REPO_ROOT.parent / "shared" / "data" / "bench", REPO_ROOT / "shared" / "data" / "bench"]
    return dirs


def resolve_dataset(spec: str) -> Path:
    """``spec-bench``, ``mt-bench`` or a path to a JSONL file."""
    if spec in DATASETS:
        for d in data_dirs():
            if (d / DATASETS[spec]).is_file():
                return d / DATASETS[spec]
        looked = ", ".join(str(d) for d in data_dirs())
        raise GraftError(f"dataset '{spec}' ({DATASETS[spec]}) not found in {looked} (set GRAFT_BENCH_DATA)")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise GraftError(f"dataset not found: {spec} (use spec-bench, mt-bench or a JSONL file)")
    return path


def parse_questions(lines: Iterable[str], source: str = "dataset") -> list[Question]:
    """Records with ``turns`` (a list of user messages) or ``prompt`` (one), ``question_id`` or ``id``
    (default: the line number) and ``category`` (default: ``all``)."""
    out, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise GraftError(f"{source} line {number}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise GraftError(f"{source} line {number}: expected a JSON object")
        turns = record.get("turns")
        if turns is None and isinstance(record.get("prompt"), str):
            turns = [record["prompt"]]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise GraftError(f'{source} line {number}: expected "turns" (non-empty texts) or "prompt" (a text)')
        qid = record.get("question_id", record.get("id", number))
        if qid in seen:
            raise GraftError(f"{source} line {number}: duplicate question id {qid!r}")
        seen.add(qid)
        out.append(Question(qid, str(record.get("category") or "all"), list(turns)))
    return out


def load_questions(path: Path, categories: Sequence[str] | None = None, limit: int | None = None) -> list[Question]:
    """The questions of ``path`` in file order, only ``categories`` (if given), the first ``limit`` of each."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GraftError(f"cannot read {path}: {e}") from None
    questions = parse_questions(text.splitlines(), str(path))
    if categories:
        known = {q.category for q in questions}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise GraftError(f"no questions of category {', '.join(unknown)} in {path} (has: {', '.join(sorted(known))})")
        questions = [q for q in questions if q.category in set(categories)]
    if limit is not None:
        taken: Counter = Counter()
        kept = []
        for q in questions:
            if taken[q.category] < limit:
                taken[q.category] += 1
                kept.append(q)
        questions = kept
    if not questions:
        raise GraftError(f"no questions to run from {path}")
    return questions


def categories_of(questions: Sequence[Question]) -> list[str]:
    return list(dict.fromkeys(q.category for q in questions))
