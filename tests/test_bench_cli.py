"""graft bench end to end: one real CLI run on a tiny random model that speaks through the real SmolLM2 tokenizer
(answers, results, resume, mismatches, shards, bad options)."""

from __future__ import annotations

import json

import dataclasses

from graft_cli.core.defaults import CPU, DEVICES
from graft_cli.drafting import profile
from graft_cli.bench.runners import PeerRunner, shared_models
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture


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
    assert command.endswith("--resume --repeats 1 --no-warmup --no-plots") and "--draft " in command

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


def test_cli_bench_repeats_report_the_fastest_round_of_agreeing_runs(tiny_dir, tmp_path, capsys, monkeypatch):
    """--repeats 2: two passes over the questions from freshly built methods, the same tokens and (the methods
    rebuilt, so Token Recycling's table does not remember the first pass's answers) the same tau both times; one
    record each; a one-round run's records are not resumed into it."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    common = ["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)), "--limit", "1",
              "--max-new-tokens", "5", "--methods", "pld,graft,hf-pld", "--out", str(out), "--no-plots", "--no-warmup"]
    code, _, stderr = run_cli(common, capsys)
    assert code == 0, stderr
    code, stdout, stderr = run_cli([*common, "--repeats", "2", "--resume"], capsys)
    assert code == 0 and "resuming" not in stderr and "different tokens" not in stderr, stderr
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["repeats"] == 2 and "2 passes" in results["config"]["interleaving"]
    assert results["rounds_disagree"] == [] and results["lossless"]["ok"]
    assert len(results["prompts"]) == 8
    for record in results["prompts"]:
        assert record["rounds"] == 2 and record["rounds_agree"] is True
        for turn in record["turns"]:
            assert len(turn["round_wall_s"]) == 2 and turn["wall_s"] == min(turn["round_wall_s"])
    lines = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert sum("round" not in x for x in lines) == 8  # the one-pass run's, kept in the file, not resumed
    lines = [x for x in lines if "round" in x]
    assert sorted(x["round"] for x in lines) == [0] * 8 + [1] * 8
    for first in (x for x in lines if x["round"] == 0):
        (second,) = [x for x in lines if x["round"] == 1 and (x["question_id"], x["method"]) == (first["question_id"], first["method"])]
        assert [t["accept_lengths"] for t in second["turns"]] == [t["accept_lengths"] for t in first["turns"]]


def test_cli_bench_budgets_with_auto(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(CPU, profile_sizes=(1, 2, 4, 8)))
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
    from graft_cli.runtime.lossless import MarginTarget

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
    from graft_cli.runtime import loading

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
        (["bench", "--repeats", "2", "--retriever-opt", "adjacency_file=t.safetensors"], "carry one pass"),
    ]:
        code, _, stderr = run_cli(argv, capsys)
        assert code == 2 and message in stderr, stderr


def test_cli_bench_runs_the_target_on_generates_modules_and_peers_on_transformers(tiny_dir, tmp_path, capsys):
    """``--forward`` auto: graft's own modules for the engine's columns, as ``graft generate`` runs them; a
    transformers column gets a transformers copy of the target; a drafter loading the same model as its draft
    gets transformers' modules, not the target's. ``--forward transformers`` runs everything there."""
    from graft_cli.models import CausalLM
    from graft_cli.runtime import loading

    for forward, modules in (("auto", "own"), ("transformers", "transformers")):
        out = tmp_path / forward
        code, _, stderr = run_cli(["bench", "--model", str(tiny_dir), "--dataset", str(_dataset(tmp_path)),
                                   "--max-new-tokens", "4", "--methods", "ar,hf-pld,dense", "--draft", str(tiny_dir),
                                   "--forward", forward, "--out", str(out), "--no-warmup", "--no-plots"], capsys)
        assert code == 0, stderr
        results = json.loads((out / "results.json").read_text())
        assert results["config"]["forward"] == modules
        assert {m["name"] for m in results["config"]["methods"]} == {"ar", "hf-pld", "dense"}
    own = loading.load_model(str(tiny_dir), "cpu", forward="own")
    with shared_models(own):
        assert isinstance(loading.load_model(str(tiny_dir), "cpu", forward="own").model, CausalLM)
        assert not isinstance(loading.load_model(str(tiny_dir), "cpu").model, CausalLM)
