"""What results.json reports: the figures per category and method (Spec-Bench's speedup, τ, and the rest), the
records without their texts, and the file itself (the table: tables.py; the answer files: answers.py; the
lossless check: graft_cli/runtime/lossless.py)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Sequence

import numpy as np

from graft_cli.bench.datasets import MT_BENCH
from graft_cli.bench.runs import question_key

RESULTS_SCHEMA = 1


@dataclass
class _Tally:
    """One method's sums over some questions, in the order the questions come (float sums keep their order)."""

    speeds: list[float] = field(default_factory=list)  # per question: its tokens over its wall time (Spec-Bench)
    walls: list[float] = field(default_factory=list)  # per question
    decode_speeds: list[float] = field(default_factory=list)  # per question with first-token times: after them
    firsts: list[float] = field(default_factory=list)  # per turn: seconds to the first tokens
    lengths: list[int] = field(default_factory=list)  # every step's accepted length
    tokens: int = 0
    steps: int = 0
    proposed: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    times: Counter = field(default_factory=Counter)
    peak: float = 0.0
    cpu: float = 0.0
    draft_forwards: int = 0
    budgeted_turns: int = 0  # turns under --budget auto, which record their mean budget
    budget_nodes: float = 0.0  # their mean budgets weighted by their steps
    budget_steps: int = 0

    def add(self, record: dict) -> None:
        turns = record["turns"]
        q_tokens = sum(t["new_tokens"] for t in turns)
        q_wall = sum(t["wall_s"] for t in turns)
        self.tokens += q_tokens
        self.walls.append(q_wall)
        self.speeds.append(q_tokens / q_wall if q_wall else 0.0)
        if all(t.get("first_token_s") is not None for t in turns):  # decoding alone: after the first tokens
            self.firsts += [t["first_token_s"] for t in turns]
            rest = q_wall - sum(t["first_token_s"] for t in turns)
            self.decode_speeds.append((q_tokens - sum(t["first_tokens"] for t in turns)) / rest if rest > 0 else 0.0)
        for t in turns:
            self._add_turn(t)

    def _add_turn(self, t: dict) -> None:
        self.lengths += t["accept_lengths"]
        self.steps += t["steps"]
        self.proposed.update(t["proposed"])
        self.accepted.update(t["accepted"])
        self.times.update(t["time_s"])
        self.peak = max(self.peak, t["peak_mem_mb"] or 0.0)
        self.cpu += t.get("cpu_s", 0.0)
        self.draft_forwards += t.get("draft_forwards", 0)
        if t.get("budget_mean") is not None:
            self.budgeted_turns += 1
            self.budget_nodes += t["budget_mean"] * t["steps"]
            self.budget_steps += t["steps"]


def _aggregate(records: Sequence[dict]) -> dict:
    """One method's figures over some questions (Spec-Bench: speed per question, then the mean)."""
    tally = _Tally()
    for r in records:
        tally.add(r)
    out = _figures(tally, records)
    if tally.budgeted_turns:
        n = tally.budget_steps
        out["budget_mean"] = round(tally.budget_nodes / n, 2) if n else None
    passes = _pass_speeds(records)
    if passes is not None:
        out["pass_tokens_per_s"] = passes
    return out


def _figures(tally: _Tally, records: Sequence[dict]) -> dict:
    walls, steps, total_proposed = tally.walls, tally.steps, sum(tally.proposed.values())
    return {
        "questions": len(records),
        "turns": sum(len(r["turns"]) for r in records),
        "new_tokens": tally.tokens,
        "wall_s": round(sum(walls), 3),
        "wall_s_per_question": round(float(np.mean(walls)), 3) if walls else 0.0,
        "tokens_per_s": round(float(np.mean(tally.speeds)), 3) if tally.speeds else 0.0,
        "tau": round(sum(tally.lengths) / len(tally.lengths), 3) if tally.lengths else 1.0,
        # time to the first tokens (the prefill, and for a peer its first step), and the speed after it
        "first_token_s": round(float(np.mean(tally.firsts)), 3) if tally.firsts else None,
        "decode_tokens_per_s": (round(float(np.mean(tally.decode_speeds)), 3)
                                if len(tally.decode_speeds) == len(records) else None),
        "steps": steps,
        "nodes_per_step": round(total_proposed / steps, 2) if steps and total_proposed else 0.0,
        "draft_forwards": tally.draft_forwards,
        "draft_forwards_per_step": round(tally.draft_forwards / steps, 2) if steps else 0.0,
        "proposed": dict(tally.proposed),
        "accepted": dict(tally.accepted),
        "time_s": {k: round(v, 3) for k, v in tally.times.items()},
        "peak_mem_mb": round(tally.peak, 1) if tally.peak else None,
        # CPU seconds of the process per wall second: near the thread count on a quiet machine, lower when other
        # work took the cores (a run to distrust)
        "cpu_per_wall": round(tally.cpu / sum(walls), 2) if tally.cpu and sum(walls) else None,
    }


def _pass_speeds(records: Sequence[dict]) -> list[float] | None:
    """With ``--repeats``: the mean tokens/s of every pass on its own (each question's turns at that pass's wall
    times), or None when a record has a single pass or passes that produced different tokens."""
    if not records or any(r.get("rounds_agree") is not True for r in records):
        return None
    passes = min(len(t.get("round_wall_s", ())) for r in records for t in r["turns"])
    if passes < 2:
        return None
    out = []
    for k in range(passes):
        speeds = []
        for r in records:  # as the fastest-pass figure: a question's tokens over its turns' wall time
            wall = sum(t["round_wall_s"][k] for t in r["turns"])
            speeds.append(sum(t["new_tokens"] for t in r["turns"]) / wall if wall else 0.0)
        out.append(round(float(np.mean(speeds)), 3))
    return out


def summarize(records: Sequence[dict], methods: Sequence[str], categories: Sequence[str]) -> dict:
    """Per category (plus ``mt_bench``, MT-Bench's eight categories together, as Spec-Bench reports them) and
    overall, per method: the figures and the speedup over ``ar``. Only questions that every method finished
    count, so that all methods are compared on the same prompts."""
    by_q: dict[str, dict[str, dict]] = {}
    for r in records:
        by_q.setdefault(question_key(r["question_id"]), {})[r["method"]] = r
    complete = {q: m for q, m in by_q.items() if all(name in m for name in methods)}
    groups = {c: [m for m in complete.values() if m[methods[0]]["category"] == c] for c in categories}
    groups = {c: g for c, g in groups.items() if g}
    mt = [c for c in groups if c in MT_BENCH]
    if len(mt) > 1 and len(mt) < len(groups):  # Spec-Bench reports MT-Bench's eight categories as one task too
        at = list(groups).index(mt[-1]) + 1
        items = list(groups.items())
        groups = dict([*items[:at], ("mt_bench", [q for c in mt for q in groups[c]]), *items[at:]])
    groups["overall"] = list(complete.values())
    out = {}
    for group, qs in groups.items():
        row = {name: _aggregate([q[name] for q in qs]) for name in methods}
        for speed, ratio in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
            base = row.get("ar", {}).get(speed) or 0.0
            for name in methods:
                mine = row[name][speed]
                row[name][ratio] = round(mine / base, 3) if base and mine is not None else None
        base_passes = row.get("ar", {}).get("pass_tokens_per_s")
        for name in methods:  # each pass's methods ran side by side: their ratios are paired, pass by pass
            mine = row[name].get("pass_tokens_per_s")
            if base_passes and mine and len(mine) == len(base_passes):
                ratios = [m / b if b else 0.0 for m, b in zip(mine, base_passes)]
                row[name]["pass_speedups"] = [round(x, 3) for x in ratios]
                row[name]["pass_speedup_median"] = round(median(ratios), 3)
        out[group] = row
    return out


def lean_record(record: dict) -> dict:
    """A record for results.json: every figure; the texts are in answers/, the token ids in runs.jsonl."""
    out = {k: v for k, v in record.items() if k != "turns"}
    out["turns"] = [{k: v for k, v in t.items() if k not in ("text", "tokens", "margins")} for t in record["turns"]]
    return out


def write_results(path: Path, results: dict) -> None:
    """results.json: indented, except one line per prompt record (a full run has hundreds)."""
    head = {k: v for k, v in results.items() if k != "prompts"}
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]  # drop the closing "\n}"
    prompts = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in results.get("prompts", []))
    path.write_text(f'{text},\n "prompts": [\n{prompts}\n ]\n}}\n')


def per_question_seconds(records: Sequence[dict], names: Sequence[str]) -> dict[str, float | None]:
    """Mean wall seconds per question of each method (every turn): what sizing a longer run needs."""
    out = {}
    for name in names:
        walls = [sum(t["wall_s"] for t in r["turns"]) for r in records if r["method"] == name]
        out[name] = round(sum(walls) / len(walls), 2) if walls else None
    return out
