"""Running the questions: turn by turn, the methods interleaved question by question (``--repeats``: in passes),
each finished (question, method) appended to a runs file at once so that an interrupted run resumes
(``--resume``) and shards merge (``--report-only``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from graft_cli.bench.datasets import Question
from graft_cli.bench.runners import Runner
from graft_cli.core import GraftError

WARMUP_PROMPT = "Write three short sentences about the sea."
WARMUP_TOKENS = 16


class Conversation:
    """Prompt formatting and answer text for multi-turn questions (Spec-Bench puts each answer back); ``fit``
    checks (or, with --truncate, cuts) every prompt against the model's limits (graft_cli/runtime/limits.py)."""

    def __init__(self, tokenizer, stop: set[int], fit: Callable[[list[int]], list[int]] | None = None) -> None:
        self.tokenizer, self.stop, self.fit = tokenizer, stop, fit

    def encode(self, messages: list[dict]) -> list[int]:
        from graft_cli.runtime.loading import encode

        ids = encode(self.tokenizer, messages)
        return self.fit(ids) if self.fit is not None else ids

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop], skip_special_tokens=True).strip()


def run_question(runner: Runner, question: Question, conv: Conversation, max_new_tokens: int) -> dict:
    """Every turn of ``question`` with ``runner``; returns its record (texts, tokens and figures per turn)."""
    messages: list[dict] = []
    turns = []
    for text in question.turns:
        messages.append({"role": "user", "content": text})
        ids = conv.encode(messages)
        cpu = time.process_time()
        turn = runner.run(ids, max_new_tokens)
        cpu = time.process_time() - cpu  # every thread of the process: about wall x threads on a quiet machine
        answer = conv.text(turn.tokens)
        messages.append({"role": "assistant", "content": answer})
        turns.append({
            "prompt_tokens": len(ids),
            "new_tokens": len(turn.tokens),
            "wall_s": round(turn.wall, 4),
            "cpu_s": round(cpu, 4),
            "tokens_per_s": round(len(turn.tokens) / turn.wall, 3) if turn.wall else 0.0,
            "tau": round(sum(turn.accept_lengths) / len(turn.accept_lengths), 4) if turn.accept_lengths else 1.0,
            "steps": turn.steps,
            "accept_lengths": turn.accept_lengths,
            "proposed": turn.proposed,
            "accepted": turn.accepted,
            "time_s": turn.time_s,
            "peak_mem_mb": round(turn.peak_mem_mb, 1) if turn.peak_mem_mb is not None else None,
            "budget_mean": turn.budget_mean,
            "draft_forwards": turn.draft_forwards,
            "first_token_s": None if turn.first_token_s is None else round(turn.first_token_s, 4),
            "first_tokens": turn.first_tokens,
            **({"margins": turn.margins} if turn.margins is not None else {}),
            "text": answer,
            "tokens": turn.tokens,
        })
    return {"question_id": question.question_id, "category": question.category, "method": runner.name,
            "turns": turns}


def interleave(questions: Sequence[Question], runners: Sequence[Runner],
               round_: int = 0) -> Iterable[tuple[Question, Runner]]:
    """Question by question, every method. The methods' order rotates by one from a question to the next and
    from a ``--repeats`` round to the next, and every other round runs backwards: a slow spell of a shared
    machine then hits every method alike."""
    n = len(runners)
    for i, q in enumerate(questions):
        order = [runners[(i + round_ + j) % n] for j in range(n)]
        for runner in order if round_ % 2 == 0 else order[::-1]:
            yield q, runner


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


Key = tuple[str, str, int]  # (question id as JSON, method, round)


def record_key(record: dict) -> tuple[str, str]:
    return json.dumps(record["question_id"]), record["method"]


def run_key(record: dict) -> Key:
    """A runs-file line's key: a record of a one-round run is its round 0."""
    return (*record_key(record), int(record.get("round", 0)))


def by_question(runs: dict[Key, dict], rounds: int = 1) -> list[dict]:
    """One record per (question, method) whose every round finished: :func:`fastest` of them."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for (qid, method, r), record in sorted(runs.items(), key=lambda kv: kv[0][2]):
        if r < rounds:
            grouped.setdefault((qid, method), []).append(record)
    return [fastest(recs) for recs in grouped.values() if len(recs) == rounds]


def runs_files(out_dir: Path, shard: tuple[int, int] | None = None) -> list[Path]:
    """Where runs are appended: ``runs.jsonl``, or ``runs.K-of-N.jsonl`` for a shard. With ``shard`` None: every
    runs file in ``out_dir`` (what --resume and --report-only merge), ``runs.jsonl`` first."""
    if shard is not None:
        return [out_dir / f"runs.{shard[0]}-of-{shard[1]}.jsonl"]
    return [out_dir / "runs.jsonl"] + sorted(out_dir.glob("runs.*-of-*.jsonl"))


def read_runs(paths: Path | Sequence[Path], fingerprints: dict[str, str]) -> dict[Key, dict]:
    """Records of earlier runs whose method fingerprint still matches (what --resume keeps), one per (question,
    method, round); a later line or file replaces an earlier record of the same key."""
    done: dict[Key, dict] = {}
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


def execute(
    questions: Sequence[Question],
    runners: Sequence[Runner],
    conv: Conversation,
    max_new_tokens: int,
    runs_path: Path | None = None,
    done: dict[Key, dict] | None = None,
    fingerprints: dict[str, str] | None = None,
    on_record: Callable[[dict], None] | None = None,
    stamp: dict | None = None,
    failed: dict[str, str] | None = None,
    rounds: int = 1,
    fresh: Callable[[], None] | None = None,
) -> list[dict]:
    """Run what is not ``done`` yet, interleaved, in ``rounds`` passes over the questions; append each record
    to ``runs_path`` as soon as it finishes. Before every pass after the first, ``fresh()`` puts the methods
    back where the run started (a method that learns, Token Recycling's table or a cost model, would otherwise
    answer a question it has already seen). Returns one record per (question, method): :func:`by_question`.

    A method that raises is dropped from the rest of the run (its error goes into ``failed``) and the others go
    on; its finished questions stay in ``runs_path`` for a later ``--resume``."""
    import traceback

    failed = failed if failed is not None else {}
    done = dict(done or {})
    out = None
    if runs_path is not None:
        runs_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(runs_path, "a", encoding="utf-8")
        if out.tell() and not runs_path.read_bytes().endswith(b"\n"):  # a line cut short by an interruption
            out.write("\n")
    try:
        for round_ in range(rounds):
            todo = [(q, r) for q, r in interleave(questions, runners, round_)
                    if (json.dumps(q.question_id), r.name, round_) not in done]
            if round_ and todo and fresh is not None:
                fresh()
            for question, runner in todo:
                if runner.name in failed:
                    continue
                try:
                    record = run_question(runner, question, conv, max_new_tokens)
                except Exception as e:  # noqa: BLE001 - one broken method must not lose hours of the others' runs
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    failed[runner.name] = (f"question {question.question_id}: {type(e).__name__}: {e} "
                                           f"({Path(where.filename).name}:{where.lineno})")
                    continue
                if fingerprints:
                    record["fingerprint"] = fingerprints.get(runner.name)
                if rounds > 1:
                    record["round"] = round_
                record.update(stamp or {}, tstamp=round(time.time(), 3))
                done[run_key(record)] = record
                if out:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                if on_record:
                    on_record(record)
    finally:
        if out:
            out.close()
    wanted = {json.dumps(q.question_id) for q in questions}
    names = {r.name for r in runners} - set(failed)
    return [r for r in by_question(done, rounds) if record_key(r)[0] in wanted and r["method"] in names]


def warm_up(runners: Sequence[Runner], conv: Conversation) -> None:
    ids = conv.encode([{"role": "user", "content": WARMUP_PROMPT}])
    for runner in runners:
        runner.run(ids, WARMUP_TOKENS)


def check_reach(questions: Sequence[Question], conv: Conversation, limits, max_new_tokens: int, depth: int) -> None:
    """Before any forward: every question's last turn, each earlier answer counted at its longest, fits the model
    (a GraftError naming the question otherwise)."""
    for q in questions:
        messages: list[dict] = []
        for text in q.turns:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        ids = conv.encode(messages[:-1]) + [0] * (max_new_tokens * (len(q.turns) - 1))
        try:
            limits.fit(ids, max_new_tokens, depth)
        except GraftError as e:
            answers = " (earlier answers counted at --max-new-tokens each)" if len(q.turns) > 1 else ""
            raise GraftError(f"question {q.question_id}{answers}: {e}") from None
