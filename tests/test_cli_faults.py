"""Faults a new user hit, each ending cleanly: one line on stderr per problem, exit 2 for bad input (0 when the
reader of stdout went away), no traceback, a batch that survives its bad lines. Real subprocesses where the
operating system is part of the case (pipes)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from tests.bench_fixtures import run_cli as run_main
from tests.bench_fixtures import tiny_dir  # noqa: F401 - the fixture: a tiny random model with SmolLM2's tokenizer
from tests.test_faults import GRAFT, graft_env


def env(tmp_path) -> dict:
    return graft_env(tmp_path / "home")


def test_a_jsonl_batch_reports_each_bad_line_and_runs_the_others(tiny_dir, tmp_path):
    lines = [
        {"id": 1, "prompt": "hi"},
        {"id": 2, "messages": []},  # was a KeyError
        {"prompt": 5, "messages": []},  # was an AttributeError
        {"id": 4, "messages": [{"role": "user", "content": 7}]},
        {"id": 5, "messages": [{"role": "user", "content": "2+2?"}]},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{broken\n"
    p = subprocess.run(GRAFT + ["generate", "--model", str(tiny_dir), "--jsonl", "-n", "3"], input=text.encode(),
                       capture_output=True, timeout=300, env=env(tmp_path))
    err = p.stderr.decode()
    assert p.returncode == 2 and "Traceback" not in err
    records = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert [r.get("id") for r in records] == [1, 2, None, 4, 5, None]
    assert "text" in records[0] and "text" in records[4]
    assert [r["line"] for r in records if "error" in r] == [2, 3, 4, 6]
    for number in (2, 3, 4, 6):
        assert err.count(f"graft: error: line {number}: ") == 1
    assert "4 of the input lines failed" in err


def test_a_closed_stdout_ends_a_jsonl_run_quietly(tiny_dir, tmp_path):
    text = "".join(json.dumps({"id": i, "prompt": f"count to {i}"}) + "\n" for i in range(200))
    p = subprocess.Popen(GRAFT + ["generate", "--model", str(tiny_dir), "--jsonl", "-n", "4"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(tmp_path))
    p.stdin.write(text.encode())
    p.stdin.close()
    assert json.loads(p.stdout.readline())["id"] == 0  # `| head -n 1`
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0 and err == ""


@pytest.mark.parametrize("argv, message", [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--datastore", "no-such-store"], "no datastore named no-such-store"),
    (["--method", "rest"], "--method rest retrieves from a datastore"),
    (["--draft", "x", "--draft-window", "10"], "--draft-window must be 0 (the whole prompt) or more than 64"),
    (["--draft", "x", "--draft-weights", "int4"], "--draft-weights must be one of fp16, full, got 'int4'"),
])
def test_method_and_datastore_are_checked_before_the_model_loads(argv, message, capsys, monkeypatch, tmp_path):
    import graft_cli.api
    import graft_cli.runtime.loading

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    # patched where `generate` calls it too: a module that imported it while patched here would keep the stand-in
    for module in (graft_cli.runtime.loading, graft_cli.api):
        monkeypatch.setattr(module, "load_model", no_loading)
    code, _, err = run_main(["generate", "-p", "hi", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("argv, message", [
    (["--retriever-opt", "foo=bar"], "--retriever-opt foo=bar: no retriever of --method graft reads it"),
    (["--method", "pld", "--retriever-opt", "recycling.k=4"], "--retriever-opt recycling.k=4: no retriever"),
    (["--method", "ar", "--adjacency-file", "x.safetensors"], "--adjacency-file: no retriever of --method ar"),
])
def test_an_option_no_retriever_reads_is_an_error(argv, message, tiny_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    code, _, err = run_main(["generate", "--model", str(tiny_dir), "-p", "hi", "-n", "2", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_options_a_retriever_reads_are_accepted(tiny_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    code, out, err = run_main(["generate", "--model", str(tiny_dir), "-p", "hi", "-n", "2", "--method", "pld",
                               "--retriever-opt", "prompt.max_match=4"], capsys)
    assert code == 0, err


def test_help_describes_every_option(capsys):
    code, out, _ = run_main(["generate", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0 and "rest" in flat.split("--method")[1][:200]
    for flag in ("--max-new-tokens", "--top-p", "--top-k"):
        described = flat.split(flag, 1)[1].split("--", 1)[0]
        assert len(described.split()) > 4, flag
    code, out, _ = run_main(["index", "build", "--help"], capsys)
    assert "default: 0" not in " ".join(out.split()).split("--jobs", 1)[1][:200]


def test_the_same_seed_gives_the_same_text_across_methods_sessions_and_learned_state(tiny_dir, tmp_path, capsys,
                                                                                     monkeypatch):
    """`--jsonl` lines after the first see warm retrievers, `--adjacency-file` state from an earlier run and
    `--budget auto` a measured profile: none of it may change sampled text."""
    from graft_cli.core.defaults import CPU, DEVICES
    from graft_cli.drafting import profile

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(CPU, profile_sizes=(1, 2, 4, 8)))
    monkeypatch.setattr(profile, "REPEATS", 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": "one two three one two three"}) + "\n" for i in range(3)))
    sampling = ["--temperature", "1.0", "--top-k", "50", "--seed", "7", "-n", "12", "--jsonl", "-f", str(prompts)]
    texts = {}
    for name, extra in [("ar", ["--method", "ar"]), ("pld", ["--method", "pld", "--budget", "auto"]),
                        ("recycling", ["--method", "recycling", "--adjacency-file", str(tmp_path / "adj.safetensors")]),
                        ("recycling-again", ["--method", "recycling", "--adjacency-file", str(tmp_path / "adj.safetensors")]),
                        ("graft", ["--method", "graft", "--budget", "3"])]:
        code, out, err = run_main(["generate", "--model", str(tiny_dir), *sampling, *extra], capsys)
        assert code == 0, err
        texts[name] = [json.loads(line)["text"] for line in out.splitlines()]
    assert len(set(texts["ar"])) == 1  # every line of one session: the same text
    assert all(t == texts["ar"] for t in texts.values()), texts
    code, out, err = run_main(["generate", "--model", str(tiny_dir), *sampling[:4], "--seed", "8", "-n", "12",
                               "--jsonl", "-f", str(prompts), "--method", "ar"], capsys)
    assert code == 0, err
    assert [json.loads(line)["text"] for line in out.splitlines()] != texts["ar"]  # and the seed matters
