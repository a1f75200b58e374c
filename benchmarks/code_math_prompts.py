"""Issue 4's prompt set as a ``graft bench --dataset`` file: the first N Spec-Bench ``coding`` and
``math_reasoning`` questions (first turn) and the first N GPTeacher codegen instructions (instruction, then its
input), one JSON line each with ``question_id``, ``category`` and ``turns``.

    python benchmarks/code_math_prompts.py --per-category 10 > code_math.jsonl
    graft bench --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dataset code_math.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def prompts(per_category: int, data: Path = DATA) -> list[dict]:
    spec = [json.loads(line) for line in (data / "bench" / "spec_bench_question.jsonl").read_text().splitlines() if line]
    out = []
    for category in ("coding", "math_reasoning"):
        rows = [q for q in spec if q["category"] == category][:per_category]
        out += [{"question_id": q["question_id"], "category": category, "turns": q["turns"][:1]} for q in rows]
    lines = (data / "corpus" / "gpteacher_codegen-instruct.jsonl").read_text().splitlines()[:per_category]
    for i, line in enumerate(lines):
        q = json.loads(line)
        text = q["instruction"] + (f"\n\n{q['input']}" if q.get("input") else "")
        out.append({"question_id": f"gpteacher-codegen-{i}", "category": "gpteacher_codegen", "turns": [text]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=10)
    args = ap.parse_args()
    for record in prompts(args.per_category):
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
