"""graft bench's parts: datasets, interleaving, the lossless check, outputs and the table (plans and variants:
test_bench_plan.py; the CLI run end to end: test_bench_cli.py; --budget auto and the latency profile:
test_budget_auto.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graft_cli.bench import plots
from graft_cli.bench.answers import write_answers
from graft_cli.bench.datasets import (
    REPO_ROOT,
    Question,
    categories_of,
    load_questions,
    parse_questions,
    resolve_dataset,
)
from graft_cli.bench.execution import Conversation, execute, interleave, run_question
from graft_cli.bench.results import summarize
from graft_cli.bench.runners import Turn
from graft_cli.bench.runs import read_runs
from graft_cli.bench.tables import table
from graft_cli.core import GraftError
from graft_cli.runtime import lossless

SPEC_BENCH_LINES = [
    '{"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it: every sentence starts with A."]}',
    '{"question_id": 82, "category": "writing", "turns": ["Draft an email.", "Shorter."]}',
    '{"question_id": 241, "category": "summarization", "turns": ["Summarize: the cat sat on the mat."], "reference": ["x"]}',
    '{"question_id": 242, "category": "summarization", "turns": ["Summarize: it rained."]}',
    '{"question_id": 401, "category": "math_reasoning", "turns": ["What is 2+2?"]}',
]


# --- datasets ------------------------------------------------------------------------------------------------
def test_spec_bench_format_categories_and_limit(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(SPEC_BENCH_LINES) + "\n\n")
    qs = load_questions(path)
    assert [q.question_id for q in qs] == [81, 82, 241, 242, 401]
    assert qs[0].turns == ["Write a travel blog post.", "Rewrite it: every sentence starts with A."]
    assert categories_of(qs) == ["writing", "summarization", "math_reasoning"]
    qs = load_questions(path, ["summarization", "writing"], limit=1)
    assert [(q.question_id, q.category) for q in qs] == [(81, "writing"), (241, "summarization")]
    with pytest.raises(GraftError, match="no questions of category nope"):
        load_questions(path, ["nope"])


def test_plain_prompt_jsonl_and_bad_records(tmp_path):
    qs = parse_questions(['{"prompt": "hello"}', '{"id": "b", "prompt": "bye", "category": "c"}'])
    assert [(q.question_id, q.category, q.turns) for q in qs] == [(1, "all", ["hello"]), ("b", "c", ["bye"])]
    for bad, message in [
        ('{"turns": []}', "turns"),
        ('{"prompt": "  "}', "turns"),
        ("[1]", "JSON object"),
        ("{nope", "invalid JSON"),
    ]:
        with pytest.raises(GraftError, match=message):
            parse_questions([bad])
    with pytest.raises(GraftError, match="duplicate"):
        parse_questions(['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'])


def test_named_datasets_resolve_through_env_and_shared_data(tmp_path, monkeypatch):
    (tmp_path / "spec_bench_question.jsonl").write_text(SPEC_BENCH_LINES[0] + "\n")
    monkeypatch.setenv("GRAFT_BENCH_DATA", str(tmp_path))
    assert resolve_dataset("spec-bench") == tmp_path / "spec_bench_question.jsonl"
    with pytest.raises(GraftError, match="dataset not found"):
        resolve_dataset(str(tmp_path / "missing.jsonl"))
    monkeypatch.delenv("GRAFT_BENCH_DATA")
    shared = REPO_ROOT.parent / "shared" / "data" / "bench" / "spec_bench_question.jsonl"
    if shared.exists():  # the real file: 13 categories, MT-Bench's 80 with two turns
        qs = load_questions(resolve_dataset("spec-bench"), limit=1)
        assert len(qs) == 13 and len(qs[0].turns) == 2
        assert len(load_questions(resolve_dataset("mt-bench"))) == 80


# --- the runner with fake methods ------------------------------------------------------------------------------
class FakeConv(Conversation):
    """Prompt ids: the lengths of the conversation's messages; answer text: the tokens joined."""

    def __init__(self):
        super().__init__(None, {0})
        self.seen = []

    def encode(self, messages):
        self.seen.append([m["content"] for m in messages])
        return [len(m["content"]) for m in messages]

    def text(self, tokens):
        return " ".join(str(t) for t in tokens if t != 0)


class FakeRunner:
    def __init__(self, name, wrong_on=None, speed=1.0, log=None, margins=None, first=None):
        self.name, self.wrong_on, self.speed, self.log, self.margins = name, wrong_on, speed, log, margins
        self.first = first  # seconds to the first token (added to the wall time)

    def run(self, ids, max_new_tokens):
        if self.log is not None:
            self.log.append(self.name)
        tokens = [(sum(ids) + i) % 50 + 1 for i in range(max_new_tokens)]
        if self.wrong_on is not None and ids[0] == self.wrong_on:
            tokens[2] += 1
        return Turn(tokens=tokens, wall=max_new_tokens / self.speed + (self.first or 0.0),
                    accept_lengths=[2] * (max_new_tokens // 2), steps=max_new_tokens // 2, proposed={"prompt": 4},
                    accepted={"prompt": 2, "bonus": 2}, time_s={"verify": 0.5}, peak_mem_mb=10.0,
                    margins=self.margins, first_token_s=self.first, first_tokens=0)


QUESTIONS = [Question(1, "a", ["one", "two!"]), Question(2, "a", ["three"]), Question(3, "b", ["four"])]


def test_interleaving_rotates_methods_question_by_question():
    log = []
    runners = [FakeRunner(n, log=log) for n in ("ar", "x", "y")]
    records = execute(QUESTIONS, runners, FakeConv(), 4)
    # question 1 has two turns: each method runs both before the next method starts
    assert log == ["ar", "ar", "x", "x", "y", "y", "x", "y", "ar", "y", "ar", "x"]
    assert len(records) == 9
    order = [(q.question_id, r.name) for q, r in interleave(QUESTIONS, runners)]
    assert order[:3] == [(1, "ar"), (1, "x"), (1, "y")] and order[3:6] == [(2, "x"), (2, "y"), (2, "ar")]


def test_repeats_are_fresh_passes_reporting_each_turns_fastest():
    """--repeats: passes over the questions, the order rotating once more and reversed every other pass, the
    methods rebuilt before each pass after the first; one record per (question, method), each turn from its
    fastest pass, every pass's wall time kept; a resumed run reruns only the passes missing."""
    runners = [FakeRunner("ar"), FakeRunner("x"), FakeRunner("y")]
    order = [r.name for k in range(3) for _, r in interleave(QUESTIONS[:1], runners, k)]
    assert order == ["ar", "x", "y", "ar", "y", "x", "y", "ar", "x"]

    class Drifting(FakeRunner):  # slower, then faster, then slower again: pass 2 is the fastest
        speeds = iter([1.0, 1.0, 4.0, 4.0, 2.0, 2.0])

        def run(self, ids, max_new_tokens):
            self.speed = next(self.speeds)
            return super().run(ids, max_new_tokens)

    fresh = []
    (record,) = execute(QUESTIONS[:1], [Drifting("ar")], FakeConv(), 4, rounds=3, fresh=lambda: fresh.append(1))
    assert fresh == [1, 1] and record["rounds"] == 3 and record["rounds_agree"] is True and "round" not in record
    assert [t["wall_s"] for t in record["turns"]] == [1.0, 1.0]
    assert record["turns"][0]["round_wall_s"] == [4.0, 1.0, 2.0]

    log = []
    first = execute(QUESTIONS[1:2], [FakeRunner("ar", log=log)], FakeConv(), 4, rounds=1)[0]
    done = {(json.dumps(2), "ar", 0): {**first, "round": 0}}
    (again,) = execute(QUESTIONS[1:2], [FakeRunner("ar", log=log)], FakeConv(), 4, done=done, rounds=2,
                       fresh=lambda: fresh.append(2))
    assert log == ["ar", "ar"] and fresh[-1] == 2 and again["rounds"] == 2


def test_repeats_never_mix_rounds_that_disagree():
    calls = []

    class Flaky(FakeRunner):  # the second pass answers differently
        def run(self, ids, max_new_tokens):
            calls.append(ids)
            turn = super().run(ids, max_new_tokens)
            if len(calls) == 2:
                turn.tokens[0] += 1
                turn.wall = 0.1
            return turn

    (record,) = execute(QUESTIONS[1:2], [Flaky("ar")], FakeConv(), 4, rounds=2)
    assert record["rounds_agree"] is False
    assert record["turns"][0]["wall_s"] == 4.0 and record["turns"][0]["round_wall_s"] == [4.0, 0.1]


def test_multi_turn_puts_each_methods_own_answer_back():
    conv = FakeConv()
    record = run_question(FakeRunner("ar"), QUESTIONS[0], conv, 3)
    first = record["turns"][0]
    assert conv.seen[0] == ["one"]
    assert conv.seen[1] == ["one", first["text"], "two!"]
    assert first["tokens"] == [4, 5, 6] and record["turns"][1]["prompt_tokens"] == 3


def test_mismatch_is_found_with_its_question_id():
    runners = [FakeRunner("ar"), FakeRunner("good"), FakeRunner("bad", wrong_on=len("three"))]
    records = execute(QUESTIONS, runners, FakeConv(), 5)
    mismatches = lossless.check_lossless(records)
    assert mismatches == [{"question_id": 2, "category": "a", "method": "bad", "turn": 1, "position": 2,
                           "tokens": 5, "ar_tokens": 5, "ar_margin": None, "tie": False}]


@pytest.mark.parametrize("margin, tie", [(0.01, True), (0.7, True), (2.0, False)])
def test_a_difference_where_ar_was_nearly_tied_is_a_tie_not_a_failure(margin, tie):
    """bf16 (tolerance 1.5): a flip where ar's top two logits were 0.01 or 0.7 apart is a floating-point tie,
    counted with its margin; where they were 2.0 apart it is a real mismatch and fails."""
    margins = [9.0, 9.0, margin, 9.0, 9.0]
    runners = [FakeRunner("ar", margins=margins), FakeRunner("good"), FakeRunner("bad", wrong_on=len("three"))]
    records = execute(QUESTIONS, runners, FakeConv(), 5)
    report = lossless.report(records, "bfloat16")
    found = (report["ties"] if tie else report["mismatches"])
    assert report["ok"] is tie and report["tie_tolerance"] == 1.5
    assert [(d["method"], d["question_id"], d["position"], d["ar_margin"]) for d in found] == [("bad", 2, 2, margin)]
    assert len(report["ties"] + report["mismatches"]) == 1
    assert not lossless.report(records, "float32")["ok"]  # fp32's tolerance (1e-3) is tight


def test_first_difference_never_calls_a_length_difference_a_tie():
    from graft_cli.runtime.lossless import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3], None, 1.0) is None
    assert first_difference([1, 2], [1, 2, 3], [0.0, 0.0, 0.0], 1.0).tie is False
    diff = first_difference([1, 5, 3], [1, 2, 3], [3.0, 0.25, 3.0], 0.5)
    assert (diff.position, diff.margin, diff.tie) == (1, 0.25, True)


class BrokenRunner(FakeRunner):
    def run(self, ids, max_new_tokens):
        if ids == [len("three")]:
            raise RuntimeError("boom")
        return super().run(ids, max_new_tokens)


def test_a_failing_method_is_dropped_and_the_others_go_on(tmp_path):
    failed, log = {}, []
    runners = [FakeRunner("ar", log=log), BrokenRunner("broken", log=log)]
    records = execute(QUESTIONS, runners, FakeConv(), 3, runs_path=tmp_path / "runs.jsonl", failed=failed)
    assert list(failed) == ["broken"] and "question 2: RuntimeError: boom" in failed["broken"]
    assert log.count("broken") == 2 and log.count("ar") == 4  # two turns of question 1, then question 2 fails
    assert {r["method"] for r in records} == {"ar"} and len(records) == 3
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 4  # broken's question 1 is kept for --resume


def test_summary_uses_spec_bench_speedup_and_pooled_tau():
    runners = [FakeRunner("ar", speed=10.0), FakeRunner("fast", speed=25.0)]
    records = execute(QUESTIONS, runners, FakeConv(), 4)
    summary = summarize(records, ["ar", "fast"], ["a", "b"])
    assert list(summary) == ["a", "b", "overall"]
    assert summary["overall"]["ar"]["tokens_per_s"] == pytest.approx(10.0)
    assert summary["overall"]["fast"]["speedup"] == pytest.approx(2.5)
    assert summary["a"]["fast"]["tau"] == 2.0 and summary["a"]["fast"]["questions"] == 2
    assert summary["overall"]["fast"]["accepted"] == {"prompt": 8, "bonus": 8}
    assert summary["overall"]["fast"]["nodes_per_step"] == 2.0


def test_decoding_alone_leaves_out_the_time_to_the_first_token():
    """A long prefill (here 2 s of every turn) hides a decoding speed-up; the decoding figures show it."""
    from rich.console import Console

    runners = [FakeRunner("ar", speed=10.0, first=2.0), FakeRunner("fast", speed=25.0, first=2.0)]
    summary = summarize(execute(QUESTIONS, runners, FakeConv(), 4), ["ar", "fast"], ["a", "b"])
    overall = summary["overall"]
    assert overall["ar"]["decode_tokens_per_s"] == pytest.approx(10.0) and overall["ar"]["first_token_s"] == 2.0
    assert overall["fast"]["decode_speedup"] == pytest.approx(2.5) and overall["fast"]["speedup"] < 1.5
    console = Console(width=120, record=True)
    console.print(table(summary, ["ar", "fast"], "t", decoding=True))
    text = console.export_text()
    assert "2.50x" in text and "decoding" in text
    plain = summarize(execute(QUESTIONS, [FakeRunner("ar")], FakeConv(), 4), ["ar"], ["a"])  # no first-token times
    assert plain["overall"]["ar"]["decode_tokens_per_s"] is None


def test_repeats_report_each_pass_on_its_own():
    """With --repeats every pass's speed-up over ar is its own (the methods of a pass ran side by side), beside
    the median and range that the third table shows; a single pass has none."""
    from rich.console import Console

    class Passes(FakeRunner):  # the machine slows every method alike in pass 2
        def __init__(self, name, speed):
            super().__init__(name, speed=speed)
            self.calls = 0

        def run(self, ids, max_new_tokens):
            self.calls += 1
            turn = super().run(ids, max_new_tokens)
            turn.wall *= 2.0 if 5 <= self.calls <= 8 else 1.0  # 4 turns a pass
            return turn

    runners = [Passes("ar", 10.0), Passes("fast", 25.0)]
    records = execute(QUESTIONS, runners, FakeConv(), 4, rounds=3)
    overall = summarize(records, ["ar", "fast"], ["a", "b"])["overall"]
    assert overall["ar"]["pass_tokens_per_s"] == [10.0, 5.0, 10.0]
    assert overall["fast"]["pass_speedups"] == [2.5, 2.5, 2.5] and overall["fast"]["pass_speedup_median"] == 2.5
    console = Console(width=120, record=True)
    console.print(table(summarize(records, ["ar", "fast"], ["a", "b"]), ["ar", "fast"], "t", passes=True))
    text = console.export_text()
    assert "2.50x [2.50-2.50]" in text and "10.00 tok/s" in text and "[lowest-highest]" in text
    single = summarize(execute(QUESTIONS, [FakeRunner("ar")], FakeConv(), 4), ["ar"], ["a"])
    assert "pass_tokens_per_s" not in single["overall"]["ar"]


def test_summary_groups_mt_bench_like_spec_bench():
    qs = [Question(1, "writing", ["a"]), Question(2, "coding", ["b"]), Question(3, "qa", ["c"])]
    records = execute(qs, [FakeRunner("ar")], FakeConv(), 2)
    assert list(summarize(records, ["ar"], ["writing", "coding", "qa"])) == \
        ["writing", "coding", "mt_bench", "qa", "overall"]
    assert summarize(records, ["ar"], ["writing", "coding", "qa"])["mt_bench"]["ar"]["questions"] == 2
    assert list(summarize(records[:2], ["ar"], ["writing", "coding"])) == ["writing", "coding", "overall"]


def test_runs_are_appended_and_resumed(tmp_path):
    runs = tmp_path / "runs.jsonl"
    fingerprints = {"ar": "f1", "x": "f2"}
    first = execute(QUESTIONS[:2], [FakeRunner("ar"), FakeRunner("x")], FakeConv(), 3, runs_path=runs, done={},
                    fingerprints=fingerprints)
    assert len(runs.read_text().splitlines()) == 4
    runs.write_text(runs.read_text() + '{"cut short')  # an interrupted write
    done = read_runs(runs, fingerprints)
    assert len(done) == 4
    log = []
    records = execute(QUESTIONS, [FakeRunner("ar", log=log), FakeRunner("x", log=log)], FakeConv(), 3, runs_path=runs,
                      done=done, fingerprints=fingerprints)
    assert log == ["ar", "x"] and len(records) == 6  # only question 3 ran
    assert len(read_runs(runs, fingerprints)) == 6
    assert read_runs(runs, {"ar": "f1", "x": "changed"}).keys() == {(json.dumps(q), "ar", 0) for q in (1, 2, 3)}
    assert first[0]["fingerprint"] == "f1"


def test_outputs_answer_files_and_plots(tmp_path):
    runners = [FakeRunner("ar", speed=10.0), FakeRunner("pld@4", speed=12.0), FakeRunner("pld@8", speed=14.0),
               FakeRunner("pld@auto", speed=13.0), FakeRunner("hf", speed=9.0)]
    records = execute(QUESTIONS, runners, FakeConv(), 4)
    for r in records:
        if r["method"] == "pld@auto":
            for t in r["turns"]:
                t["budget_mean"] = 6.5
    names = [r.name for r in runners]
    methods = [{"name": "ar", "method": "ar", "kind": "engine", "budget": None},
               {"name": "pld@4", "method": "pld", "kind": "engine", "budget": 4},
               {"name": "pld@8", "method": "pld", "kind": "engine", "budget": 8},
               {"name": "pld@auto", "method": "pld", "kind": "engine", "budget": "auto"},
               {"name": "hf", "method": "hf", "kind": "peer", "budget": None}]
    results = {"config": {"methods": methods, "model": {"spec": "m"}, "dataset": {"spec": "d"}, "max_new_tokens": 4,
                          "device": {"device": "cpu"}, "default_budget": 16},
               "summary": summarize(records, names, ["a", "b"])}
    assert results["summary"]["overall"]["pld@auto"]["budget_mean"] == 6.5
    lines, refs = plots.pareto_points(results)
    assert [p.budget for p in lines["pld"]] == [4.0, 6.5, 8.0] and set(refs) == {"ar", "hf"}
    assert [p.auto for p in lines["pld"]] == [False, True, False]
    for path in plots.write_all(tmp_path, results):
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    paths = write_answers(tmp_path, records, names, QUESTIONS, "m")
    assert [p.name for p in paths] == ["ar.jsonl", "pld-b4.jsonl", "pld-b8.jsonl", "pld-bauto.jsonl", "hf.jsonl"]
    line = json.loads(paths[1].read_text().splitlines()[0])
    assert line["question_id"] == 1 and line["model_id"] == "m-pld-b4"
    choice = line["choices"][0]
    assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
    assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])


def test_plots_leave_matplotlib_as_they_found_it(tmp_path):
    """Importing graft_cli.bench.plots and drawing with it sets no backend and loads no pyplot: a program that imports
    graft keeps its own matplotlib setup."""
    code = f"""
import sys, matplotlib
backend = matplotlib.rcParams._get("backend")
from graft_cli.bench import plots
figs = {{"speedup": 1.0, "tau": 1.0}}
plots.speedup_by_category({{"summary": {{"overall": {{"ar": figs}}}}, "config": {{"methods": [{{"name": "ar"}}],
    "model": {{"spec": "m"}}, "dataset": {{"spec": "d"}}, "max_new_tokens": 4, "device": {{"device": "cpu"}}}}}},
    __import__("pathlib").Path({str(tmp_path)!r}) / "s.png")
print(matplotlib.rcParams._get("backend") == backend, "matplotlib.pyplot" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["True", "False"] and (tmp_path / "s.png").stat().st_size > 1000


def test_table_renders_every_category_and_method():
    from rich.console import Console

    records = execute(QUESTIONS, [FakeRunner("ar", speed=10.0), FakeRunner("pld", speed=15.0)], FakeConv(), 4)
    console = Console(width=120, record=True)
    console.print(table(summarize(records, ["ar", "pld"], ["a", "b"]), ["ar", "pld"], "t"))
    text = console.export_text()
    assert "overall" in text and "1.50x τ2.00" in text and "10.00 tok/s" in text
