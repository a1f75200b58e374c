"""Spec-Bench's answer files: one JSONL file per method in FastChat's ``model_answer/<model_id>.jsonl`` layout, so
that Spec-Bench's own scripts (speed, judging) read a graft run as they read theirs."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Sequence

from graft_cli.bench.datasets import Question
from graft_cli.bench.runs import question_key


def safe_name(name: str) -> str:
    """A method's name as a file name: ``pld@8`` is ``pld-b8``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("@", "-b"))


def write_answers(out_dir: Path, records: Sequence[dict], methods: Sequence[str], questions: Sequence[Question],
                  model_id: str) -> list[Path]:
    """One Spec-Bench answer file per method (``model_answer/<model_id>.jsonl`` layout, one line a question in
    the dataset's order)."""
    order = {question_key(q.question_id): i for i, q in enumerate(questions)}
    paths = []
    answers = out_dir / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    for name in methods:
        mine = sorted((r for r in records if r["method"] == name),
                      key=lambda r: order.get(question_key(r["question_id"]), 0))
        path = answers / f"{safe_name(name)}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for r in mine:
                f.write(json.dumps(_answer(r, name, model_id), ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def _answer(record: dict, name: str, model_id: str) -> dict:
    """One question's line; a step-less method (a transformers peer) counts each token as a step of one."""
    turns = record["turns"]
    return {
        "question_id": record["question_id"],
        "category": record["category"],
        "answer_id": hashlib.sha256(f"{model_id}-{name}-{record['question_id']}".encode()).hexdigest()[:22],
        "model_id": f"{model_id}-{safe_name(name)}",
        "choices": [{
            "index": 0,
            "turns": [t["text"] for t in turns],
            "new_tokens": [t["new_tokens"] for t in turns],
            "wall_time": [t["wall_s"] for t in turns],
            "accept_lengths": [x for t in turns for x in (t["accept_lengths"] or [1] * t["new_tokens"])],
        }],
        "tstamp": record.get("tstamp", time.time()),
    }
