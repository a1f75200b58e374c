"""graft bench: datasets, interleaving, the lossless check, outputs, the latency profile and one real CLI run
on a tiny random model that speaks through the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from graft_cli import lossless, plots, profile
from graft_cli.bench.datasets import REPO_ROOT, Question, categories_of, load_questions, parse_questions, resolve_dataset
from graft_cli.bench.execution import Conversation, execute, interleave, read_runs, run_question
from graft_cli.bench.plan import MethodSpec, Variant, method_config, plan_methods
from graft_cli.bench.results import summarize, table, write_answers
from graft_cli.bench.runners import PeerRunner, Turn, shared_models
from graft_cli.budget import LatencyModel
from graft_cli.cli import main
from graft_cli.errors import GraftError
from graft_cli.stats import Stats
from graft_cli.tree import ROOT, Tree

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
    def __init__(self, name, wrong_on=None, speed=1.0, log=None, margins=None):
        self.name, self.wrong_on, self.speed, self.log, self.margins = name, wrong_on, speed, log, margins

    def run(self, ids, max_new_tokens):
        if self.log is not None:
            self.log.append(self.name)
        tokens = [(sum(ids) + i) % 50 + 1 for i in range(max_new_tokens)]
        if self.wrong_on is not None and ids[0] == self.wrong_on:
            tokens[2] += 1
        return Turn(tokens, max_new_tokens / self.speed, [2] * (max_new_tokens // 2), max_new_tokens // 2,
                    {"prompt": 4}, {"prompt": 2, "bonus": 2}, {"verify": 0.5}, 10.0, margins=self.margins)


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
    from graft_cli.lossless import first_difference

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
    records = execute(QUESTIONS, runners, FakeConv(), 3, tmp_path / "runs.jsonl", failed=failed)
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
    first = execute(QUESTIONS[:2], [FakeRunner("ar"), FakeRunner("x")], FakeConv(), 3, runs, {}, fingerprints)
    assert len(runs.read_text().splitlines()) == 4
    runs.write_text(runs.read_text() + '{"cut short')  # an interrupted write
    done = read_runs(runs, fingerprints)
    assert len(done) == 4
    log = []
    records = execute(QUESTIONS, [FakeRunner("ar", log=log), FakeRunner("x", log=log)], FakeConv(), 3, runs,
                            done, fingerprints)
    assert log == ["ar", "x"] and len(records) == 6  # only question 3 ran
    assert len(read_runs(runs, fingerprints)) == 6
    assert read_runs(runs, {"ar": "f1", "x": "changed"}).keys() == {(json.dumps(q), "ar") for q in (1, 2, 3)}
    assert first[0]["fingerprint"] == "f1"


def test_plan_methods_puts_ar_first_and_expands_budgets():
    specs = plan_methods(["pld", "hf"], ["ar", "pld", "graft"], [4, "auto"])
    assert [(s.name, s.budget) for s in specs] == [("ar", None), ("pld@4", 4), ("pld@auto", "auto"), ("hf", None)]
    assert [s.name for s in plan_methods(["graft", "ar"], ["ar", "graft"], [8])] == ["ar", "graft"]
    with pytest.raises(GraftError, match="unknown method nope"):
        plan_methods(["nope"], ["ar"], [])


def test_method_opts_set_method_config_fields_by_type():
    spec = MethodSpec("pld@4", "pld", "engine", 4)
    config = method_config(spec, {"datastore": "x"}, "draft-model", {"retrievers": "prompt,recycling"})
    assert config.budget == 4 and config.options == {"datastore": "x"} and config.retrievers == ["prompt", "recycling"]
    assert method_config(MethodSpec("ar", "ar", "engine"), {}, None, {"retrievers": "x"}).retrievers is None
    with pytest.raises(GraftError, match="not a method setting"):
        method_config(spec, {}, None, {"nope": "1"})


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
    assert [p[0] for p in lines["pld"]] == [4.0, 6.5, 8.0] and set(refs) == {"ar", "hf"}
    for path in plots.write_all(tmp_path, results):
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    paths = write_answers(tmp_path, records, names, QUESTIONS, "m")
    assert [p.name for p in paths] == ["ar.jsonl", "pld-b4.jsonl", "pld-b8.jsonl", "pld-bauto.jsonl", "hf.jsonl"]
    line = json.loads(paths[1].read_text().splitlines()[0])
    assert line["question_id"] == 1 and line["model_id"] == "m-pld-b4"
    choice = line["choices"][0]
    assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
    assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])


def test_table_renders_every_category_and_method():
    from rich.console import Console

    records = execute(QUESTIONS, [FakeRunner("ar", speed=10.0), FakeRunner("pld", speed=15.0)], FakeConv(), 4)
    console = Console(width=120, record=True)
    console.print(table(summarize(records, ["ar", "pld"], ["a", "b"]), ["ar", "pld"], "t"))
    text = console.export_text()
    assert "overall" in text and "1.50x τ2.00" in text and "10.00 tok/s" in text


# --- --budget auto ---------------------------------------------------------------------------------------------
def test_parse_budget():
    assert profile.parse_budget(None) is None
    assert profile.parse_budget("auto") == "auto" and profile.parse_budget(" AUTO ") == "auto"
    assert profile.parse_budget("12") == 12
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(GraftError, match="--budget"):
            profile.parse_budget(bad)


class _Inner:
    wants_hidden = False

    def __init__(self, scores):
        self.scores = scores
        self.observed = []

    def start(self, prompt, prefill):
        pass

    def propose(self, context, stats):
        tree = Tree()
        parent = ROOT
        for i, s in enumerate(self.scores):  # a chain with falling path scores
            parent = tree.add(parent, 10 + i, "x", s)
        return tree

    def observe(self, step):
        self.observed.append(step)


def test_auto_budget_keeps_the_best_rate_prefix_and_reports_it():
    latency = LatencyModel({1: 1.0, 2: 1.1, 4: 1.3, 8: 3.0})
    inner = _Inner([0.9, 0.8, 0.7, 0.1, 0.05, 0.01])
    auto = profile.AutoBudget(inner, latency)
    stats = Stats()
    tree = auto.propose([1, 2], stats)
    assert latency.best_count(0, 0.0, inner.scores) == 3 == len(tree)
    assert [n.token for n in tree.nodes] == [10, 11, 12]
    assert auto.chosen == [3]
    if hasattr(stats, "budgets"):
        assert stats.budgets == [3]


def test_auto_budget_counts_the_drafting_already_spent():
    """A step that already spent a second drafting gains more from a wider tree: keep more nodes."""
    latency = LatencyModel({1: 0.4, 2: 0.5, 4: 0.8, 8: 1.6, 16: 3.2})
    inner = _Inner([0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1])
    ticks = iter([0.0, 0.0])
    free = profile.AutoBudget(inner, latency, clock=lambda: next(ticks))
    ticks_slow = iter([0.0, 1.0])
    slow = profile.AutoBudget(inner, latency, clock=lambda: next(ticks_slow))
    assert len(free.propose([1], Stats())) < len(slow.propose([1], Stats()))
    assert slow.chosen == [latency.best_count(0, 0.0, inner.scores, overhead=1.0)]


def test_auto_budget_follows_the_cost_curve():
    inner = _Inner([0.9] * 20)
    flat = profile.AutoBudget(inner, LatencyModel({1: 1.0, 32: 1.01}))  # a GPU: width is nearly free
    steep = profile.AutoBudget(inner, LatencyModel({1: 1.0, 2: 2.0, 32: 32.0}))  # every node costs a forward
    assert len(flat.propose([1], Stats())) == 20
    assert len(steep.propose([1], Stats())) == 0


# --- a real CLI run on a tiny random model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 1-layer, 32-wide random Llama with SmolLM2's vocabulary, saved with the real SmolLM2 tokenizer."""
    from tests.tiny import tiny_smollm2

    model, tokenizer = tiny_smollm2()
    path = tmp_path_factory.mktemp("tiny") / "tiny-smollm2"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _dataset(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join([
        '{"question_id": 1, "category": "chat", "turns": ["Say hello.", "Again, louder."]}',
        '{"question_id": 2, "category": "code", "turns": ["def add(a, b):\\n    return a + b\\n\\nRepeat the code above."]}',
        '{"question_id": 3, "category": "code", "turns": ["Not run: the limit is one per category."]}',
    ]) + "\n")
    return path


def test_cli_bench_end_to_end_on_a_tiny_model(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                    "--limit", "1", "--max-new-tokens", "6", "--methods", "pld,hf,hf-pld,hf-assisted",
                                    "--draft", str(tiny_dir), "--out", str(out)], capsys)
    assert code == 0, stderr
    assert "overall" in stdout and "hf-pld" in stdout and "tok/s" in stdout
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == 1 and results["complete"] and results["lossless"] == {
        "ok": True, "tie_tolerance": 1e-3, "dtype": "float32", "mismatches": [], "ties": []}
    config = results["config"]
    assert [m["name"] for m in config["methods"]] == ["ar", "pld", "hf", "hf-pld", "hf-assisted"]
    assert config["draft"]["checksum"] == config["model"]["checksum"]
    assert len(config["model"]["checksum"]) == 64 and config["versions"]["torch"] and config["device"]["device"] == "cpu"
    assert config["command"].startswith("graft bench --model ") and "--max-new-tokens 6" in config["command"]
    assert set(results["summary"]) == {"chat", "code", "overall"}
    for name in ("ar", "pld", "hf", "hf-pld", "hf-assisted"):
        figs = results["summary"]["overall"][name]
        assert figs["questions"] == 2 and figs["turns"] == 3 and figs["new_tokens"] > 0 and figs["tokens_per_s"] > 0
        assert figs["speedup"] is not None and figs["peak_mem_mb"] > 0 and figs["cpu_per_wall"] > 0
    assert results["summary"]["overall"]["ar"]["speedup"] == 1.0
    assert results["summary"]["overall"]["hf-assisted"]["tau"] > 1  # the draft is the target itself
    assert len(results["prompts"]) == 10 and "method_s_per_question" in results["timing"]
    for name in ("ar", "pld", "hf", "hf-pld", "hf-assisted"):
        lines = (out / "answers" / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(x)["question_id"] for x in lines] == [1, 2]
        assert len(json.loads(lines[0])["choices"][0]["turns"]) == 2
    assert (out / "speedup_by_category.png").exists() and (out / "pareto.png").exists()
    assert len((out / "runs.jsonl").read_text().splitlines()) == 10

    # --resume with everything done runs nothing and reports the same figures
    code, stdout, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                    "--limit", "1", "--max-new-tokens", "6", "--methods", "pld,hf,hf-pld,hf-assisted",
                                    "--draft", str(tiny_dir), "--out", str(out), "--resume", "--no-warmup",
                                    "--no-plots"], capsys)
    assert code == 0 and "10 of 10 runs already done" in stderr, stderr
    command = json.loads((out / "results.json").read_text())["config"]["command"]
    assert command.endswith("--resume --no-warmup --no-plots") and "--draft " in command

    # --report-only rewrites the outputs from runs.jsonl, for the methods asked, running nothing
    (out / "results.json").unlink()
    code, stdout, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                    "--limit", "1", "--max-new-tokens", "6", "--methods", "pld", "--out", str(out),
                                    "--report-only", "--no-plots"], capsys)
    assert code == 0, stderr
    report = json.loads((out / "results.json").read_text())
    assert report["report_only"] and list(report["summary"]["overall"]) == ["ar", "pld"]
    assert report["summary"]["overall"]["pld"] == results["summary"]["overall"]["pld"]
    code, _, stderr = run_cli(["bench", "--model", str(tiny_dir), "--out", str(tmp_path / "empty"), "--report-only"],
                              capsys)
    assert code == 2 and "no " in stderr and "runs.jsonl" in stderr
    again = json.loads((out / "results.json").read_text())
    assert again["summary"]["overall"]["pld"]["new_tokens"] == results["summary"]["overall"]["pld"]["new_tokens"]


def test_cli_bench_budgets_with_auto(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(profile, "CPU_SIZES", (1, 2, 4, 8))
    monkeypatch.setattr(profile, "REPEATS", 1)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                    "--categories", "code", "--limit", "1", "--max-new-tokens", "8", "--methods", "pld",
                                    "--budgets", "2,auto", "--out", str(out), "--no-warmup"], capsys)
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    assert [(m["name"], m["budget"]) for m in results["config"]["methods"]] == [
        ("ar", None), ("pld@2", 2), ("pld@auto", "auto")]
    overall = results["summary"]["overall"]
    assert overall["pld@2"]["nodes_per_step"] <= 2
    assert overall["pld@auto"]["budget_mean"] is not None
    assert (out / "pareto.png").exists() and (out / "answers" / "pld-bauto.jsonl").exists()


def test_cli_bench_mismatch_exits_1_after_writing_results(tiny_dir, tmp_path, capsys, monkeypatch):
    real = PeerRunner.run

    def corrupt(self, ids, max_new_tokens):
        turn = real(self, ids, max_new_tokens)
        turn.tokens = [*turn.tokens[:-1], (turn.tokens[-1] + 1) % 49152]
        return turn

    monkeypatch.setattr(PeerRunner, "run", corrupt)
    out = tmp_path / "out"
    code, _, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                               "--categories", "code", "--limit", "1", "--max-new-tokens", "4", "--methods", "ar,hf",
                               "--out", str(out), "--no-warmup", "--no-plots"], capsys)
    assert code == 1
    assert "not lossless: hf differs from ar on question 2" in stderr
    results = json.loads((out / "results.json").read_text())
    assert results["lossless"]["ok"] is False
    assert results["lossless"]["mismatches"][0]["question_id"] == 2
    assert results["lossless"]["mismatches"][0]["ar_margin"] > 1e-3  # a real difference, not a tie

    # the same flip where ar's top two logits were tied is a floating-point tie: shown, counted, exit 0
    from graft_cli.lossless import MarginTarget

    monkeypatch.setattr(MarginTarget, "margins", lambda self: [0.0] * len(self._margins))
    code, stdout, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                    "--categories", "code", "--limit", "1", "--max-new-tokens", "4", "--methods",
                                    "ar,hf", "--out", str(out), "--no-warmup", "--no-plots"], capsys)
    assert code == 0, stderr
    assert "floating-point tie: hf differs from ar on question 2" in stderr
    assert "0 mismatches, 1 floating-point ties" in stdout
    results = json.loads((out / "results.json").read_text())
    assert results["lossless"]["ok"] and results["lossless"]["ties"][0]["ar_margin"] == 0.0
    assert "margins" in json.loads((out / "runs.jsonl").read_text().splitlines()[0])["turns"][0]


def test_shared_models_hands_out_the_loaded_copy(tiny_dir):
    from graft_cli import loading

    loaded = loading.load_model(str(tiny_dir), "cpu")
    original = loading.load_model
    with shared_models(loaded):
        assert loading.load_model(str(tiny_dir), "cpu", "float32") is loaded
        assert loading.load_model(str(tiny_dir)) is loaded
    assert loading.load_model is original


def test_cli_bench_shards_run_apart_and_merge_in_the_report(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)), "--max-new-tokens", "4",
              "--methods", "pld,dense", "--draft", str(tiny_dir), "--out", str(out), "--no-warmup", "--no-plots"]
    for k in (0, 1):
        code, _, stderr = run_cli(common + ["--shard", f"{k}/2"], capsys)
        assert code == 0 and f"runs.{k}-of-2.jsonl" in stderr.replace("\n", ""), stderr
    ids = [[json.loads(x)["question_id"] for x in (out / f"runs.{k}-of-2.jsonl").read_text().splitlines()]
           for k in (0, 1)]
    assert sorted(ids[0]) == [1, 1, 1, 3, 3, 3] and ids[1] == [2, 2, 2]  # questions 0 and 2 of 3, then 1
    assert not (out / "results.json").exists() and (out / "results.1-of-2.json").exists()
    code, _, stderr = run_cli(common + ["--report-only"], capsys)
    assert code == 0, stderr
    merged = json.loads((out / "results.json").read_text())
    assert merged["complete"] and merged["summary"]["overall"]["pld"]["questions"] == 3
    dense, pld = merged["summary"]["overall"]["dense"], merged["summary"]["overall"]["pld"]
    assert dense["draft_forwards"] >= dense["steps"] and dense["draft_forwards_per_step"] >= 1
    assert pld["draft_forwards"] == 0
    code, _, stderr = run_cli(common + ["--shard", "0/2", "--report-only"], capsys)
    assert code == 2 and "without --shard" in stderr


def test_cli_bench_rejects_bad_options(tmp_path, capsys):
    for argv, message in [
        (["bench", "--methods", "nope", "--dataset", str(_dataset(tmp_path))], "unknown method nope"),
        (["bench", "--budget", "4", "--budgets", "4,8"], "not both"),
        (["bench", "--budgets", "4,x"], "--budget"),
        (["bench", "--methods", "hf-assisted", "--dataset", str(_dataset(tmp_path))], "needs a draft model"),
        (["bench", "--dataset", str(tmp_path / "none.jsonl")], "dataset not found"),
        (["bench", "--shard", "2/2"], "--shard expects K/N"),
        (["bench", "--shard", "x"], "--shard expects K/N"),
    ]:
        code, _, stderr = run_cli(argv, capsys)
        assert code == 2 and message in stderr, stderr


# --- the latency profile -----------------------------------------------------------------------------------------
def test_profile_curve_takes_the_fastest_run_and_never_falls():
    curve, noise = profile.summarize({1: [0.1, 0.3, 0.1], 2: [0.5, 0.4, 0.6], 4: [0.2, 0.3, 0.25], 8: [0.9, 1.0, 0.9]})
    assert curve == {1: 0.1, 2: 0.4, 4: 0.4, 8: 0.9}  # a busy machine made n=2 look dearer than n=4
    assert noise == pytest.approx(0.25)


def test_profile_is_measured_once_and_cached(tiny_dir, tmp_path, monkeypatch):
    from graft_cli.loading import load_model

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(profile, "CPU_SIZES", (1, 2, 4, 8))
    monkeypatch.setattr(profile, "REPEATS", 2)
    loaded = load_model(str(tiny_dir), "cpu")
    latency = profile.latency_model(loaded, quiet=True)
    assert sorted(latency.points) == [1, 2, 4, 8] and all(v > 0 for v in latency.points.values())
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and files[0].name.endswith(f"-cpu-{torch.get_num_threads()}t-float32.json")
    data = json.loads(files[0].read_text())
    assert data["latency_s"] and data["context_tokens"] == profile.CONTEXT

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(profile, "measure", boom)
    assert profile.latency_model(loaded).points == latency.points  # from the cache
    assert profile.cap(latency) == 7
    with pytest.raises(AssertionError):
        profile.latency_model(loaded, refresh=True)


def test_build_auto_wraps_the_method_at_the_cap(tiny_dir, tmp_path, monkeypatch):
    from graft_cli import methods
    from graft_cli.loading import load_model

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(profile, "measure", lambda model, sizes, **k: {n: [1.0 + n / 8] for n in (1, 2, 4, 8, 16)})
    loaded = load_model(str(tiny_dir), "cpu")
    seen = []

    def fake_build(config, loaded):
        seen.append(config.budget)
        return methods.build(config, loaded)

    proposer = profile.build_auto(methods.MethodConfig("pld", "auto"), loaded, fake_build)
    assert isinstance(proposer, profile.AutoBudget) and seen == [15]
    assert proposer.latency.points[16] == 3.0
    assert not isinstance(profile.build_auto(methods.MethodConfig("ar", "auto"), loaded, fake_build), profile.AutoBudget)


def test_generate_budget_auto_reports_the_chosen_budget(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(profile, "CPU_SIZES", (1, 2, 4, 8))
    monkeypatch.setattr(profile, "REPEATS", 1)
    argv = ["generate", "--model", str(tiny_dir), "--method", "pld", "--budget", "auto", "--stats", "-n", "8",
            "--prompt", "one two three one two three one two three"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "budget auto:" in err and "nodes per step" in err
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    code, _, err = run_cli([*argv[:-2], "--budget", "many", "--prompt", "x"], capsys)
    assert code == 2 and "--budget must be 'auto'" in err


def test_variants_run_as_named_methods_with_their_own_settings():
    variants = {"deep": Variant("graft", {"depth": "14"})}
    specs = plan_methods(["dense", "deep"], ["ar", "dense", "graft"], [16, "auto"], variants)
    assert [s.name for s in specs] == ["ar", "dense@16", "dense@auto", "deep@16", "deep@auto"]
    assert specs[3].method == "graft" and specs[3].as_dict()["opts"] == {"depth": "14"}
    assert "opts" not in specs[1].as_dict()  # fingerprints of plain methods stay as they were
    config = method_config(specs[3], {}, "draft", {"depth": "6", "draft_top_k": "3"})
    assert (config.method, config.depth, config.draft_top_k) == ("graft", 14, 3)  # the variant wins over --method-opt
    with pytest.raises(GraftError, match="name of a method"):
        plan_methods(["graft"], ["ar", "graft"], [], {"graft": Variant("graft", {})})
    with pytest.raises(GraftError, match="not an engine method"):
        plan_methods(["x"], ["ar", "graft"], [], {"x": Variant("hf", {})})


def test_variant_flag_is_parsed_and_bad_ones_are_one_line_errors():
    from graft_cli.cli_bench import _variant

    assert _variant("deep=graft depth=14 prune_at=0:0.5,floor:0.3") == (
        "deep", Variant("graft", {"depth": "14", "prune_at": "0:0.5,floor:0.3"}))
    for bad in ["", "deep", "=graft", "deep=graft depth"]:
        with pytest.raises(GraftError):
            _variant(bad)
