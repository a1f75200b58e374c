"""Running the questions: turn by turn, the methods interleaved question by question (``--repeats``: in passes),
each finished (question, method) appended to a runs file at once (graft_cli/bench/runs.py) so that an
interrupted run resumes (``--resume``) and shards merge (``--report-only``)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from graft_cli.bench.datasets import Question
from graft_cli.bench.runners import Runner, Turn
from graft_cli.bench.runs import RunKey, RunsLog, by_question, question_key, run_key
from graft_cli.core import GraftError
from graft_cli.runtime.limits import Limits
from graft_cli.runtime.loading import encode

WARMUP_PROMPT = "Write three short sentences about the sea."
WARMUP_TOKENS = 16


class Conversation:
    """Prompt formatting and answer text for multi-turn questions (Spec-Bench puts each answer back); ``fit``
    checks (or, with --truncate, cuts) every prompt against the model's limits (graft_cli/runtime/limits.py)."""

    def __init__(self, tokenizer: Any, stop: set[int], fit: Callable[[list[int]], list[int]] | None = None) -> None:
        self.tokenizer, self.stop, self.fit = tokenizer, stop, fit

    def encode(self, messages: list[dict]) -> list[int]:
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
        turns.append(turn_record(turn, len(ids), cpu, answer))
    return {"question_id": question.question_id, "category": question.category, "method": runner.name,
            "turns": turns}


def turn_record(turn: Turn, prompt_tokens: int, cpu_s: float, answer: str) -> dict:
    """One turn as the runs files and results.json keep it: its figures rounded, then its text and tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(turn.tokens),
        "wall_s": round(turn.wall, 4),
        "cpu_s": round(cpu_s, 4),
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
    }


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


def execute(
    questions: Sequence[Question],
    runners: Sequence[Runner],
    conv: Conversation,
    max_new_tokens: int,
    *,
    runs_path: Path | None = None,
    done: dict[RunKey, dict] | None = None,
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
    failed = failed if failed is not None else {}
    done = dict(done or {})
    with RunsLog(runs_path) as log:
        for round_ in range(rounds):
            todo = [(q, r) for q, r in interleave(questions, runners, round_)
                    if RunKey(question_key(q.question_id), r.name, round_) not in done]
            if round_ and todo and fresh is not None:
                fresh()
            for question, runner in todo:
                if runner.name in failed:
                    continue
                record = _attempt(runner, question, conv, max_new_tokens, failed)
                if record is None:
                    continue
                if fingerprints:
                    record["fingerprint"] = fingerprints.get(runner.name)
                if rounds > 1:
                    record["round"] = round_
                record.update(stamp or {}, tstamp=round(time.time(), 3))
                done[run_key(record)] = record
                log.append(record)
                if on_record:
                    on_record(record)
    wanted = {question_key(q.question_id) for q in questions}
    names = {r.name for r in runners} - set(failed)
    return [r for r in by_question(done, rounds) if question_key(r["question_id"]) in wanted and r["method"] in names]


def _attempt(runner: Runner, question: Question, conv: Conversation, max_new_tokens: int,
             failed: dict[str, str]) -> dict | None:
    """:func:`run_question`, or None with the method's error put in ``failed`` (the question and where it
    raised): one broken method must not lose hours of the others' runs."""
    try:
        return run_question(runner, question, conv, max_new_tokens)
    except Exception as e:  # noqa: BLE001 - whatever a method raises, the others go on
        where = traceback.extract_tb(e.__traceback__)[-1]
        failed[runner.name] = (f"question {question.question_id}: {type(e).__name__}: {e} "
                               f"({Path(where.filename).name}:{where.lineno})")
        return None


def warm_up(runners: Sequence[Runner], conv: Conversation) -> None:
    """One short untimed generation per method: the first call's one-time costs (kernels, caches) stay out of
    the figures."""
    ids = conv.encode([{"role": "user", "content": WARMUP_PROMPT}])
    for runner in runners:
        runner.run(ids, WARMUP_TOKENS)


def check_reach(questions: Sequence[Question], conv: Conversation, limits: Limits, max_new_tokens: int,
                depth: int) -> None:
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
