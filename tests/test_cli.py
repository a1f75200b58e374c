"""The command line: one-line errors with exit code 2, through Typer's runner and a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graft_cli.cli import main


def run_main(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    with pytest.raises(SystemExit) as e:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize(
    "argv, stdin, message",
    [
        (["generate", "--bogus"], None, "No such option: --bogus"),
        (["generate", "--prompt", "   "], None, "the prompt is empty"),
        (["generate", "--prompt-file", "/no/such/file"], None, "prompt file not found"),
        (["generate", "--prompt-file", "-"], b"\xff\xfe bad", "is not valid UTF-8"),
        (["generate", "--prompt", "hi", "--model", "no-such-model"], None, "unknown model 'no-such-model'"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], None, "--temperature"),
        (["generate", "--prompt", "hi", "--device", "cuda"], None, "CUDA"),
        (["generate", "--prompt", "hi", "--prompt-file", "x"], None, "give the prompt once"),
        (["generate", "--prompt", "hi", "--tree", "deep"], None, "--tree must be 'cost' or 'fixed'"),
        (["generate", "--prompt", "hi", "--tree", "cost"], None, "--tree cost chooses a drafter's tree"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, stdin, message, capsys, monkeypatch):
    if "cuda" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code, out, err = run_main(argv, capsys, stdin, monkeypatch)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("graft: error:") and message in err
    assert "Traceback" not in err


def test_help_lists_the_whole_command_tree(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for command in ("generate", "index", "bench", "models", "heads", "plugins"):
        assert command in out


def test_plugins_list_shows_builtins(capsys):
    code, out, _ = run_main(["plugins", "list", "--json"], capsys)
    names = {json.loads(line)["name"] for line in out.splitlines()}
    assert code == 0 and "prompt" in names


@pytest.mark.real_model
def test_subprocess_pipeline_with_the_default_model():
    graft = [sys.executable, "-m", "graft_cli"]
    text = subprocess.run(
        graft + ["generate", "-f", "-", "-n", "8", "--method", "pld"],
        input=b"Name three colours.", capture_output=True, timeout=300,
    )
    assert text.returncode == 0, text.stderr.decode()
    assert text.stdout.decode().strip()
    lines = b'{"id": "a", "prompt": "Say hi"}\n{broken\n{"id": "b", "messages": [{"role": "user", "content": "2+2?"}]}\n'
    jsonl = subprocess.run(graft + ["generate", "--jsonl", "-n", "6"], input=lines, capture_output=True, timeout=300)
    assert jsonl.returncode == 2
    assert "line 2: invalid JSON" in jsonl.stderr.decode()
    records = [json.loads(line) for line in jsonl.stdout.decode().splitlines()]
    assert [r["id"] for r in records if "text" in r] == ["a", "b"]
    assert [r["line"] for r in records if "error" in r] == [2]  # the bad line's error record, in its place


@pytest.mark.real_model
def test_a_jsonl_batch_shares_its_prefixes_and_keeps_its_tokens():
    """Lines that begin alike resume from the prefix cache (cached tokens in their stats), with the tokens each
    line gets with the cache off."""
    system = {"role": "system", "content": "You answer for a library: books are lent for three weeks, renewed "
                                           "twice, and returned at any branch. Be brief."}
    lines = "".join(json.dumps({"id": i, "messages": [system, {"role": "user", "content": q}]}) + "\n"
                    for i, q in enumerate(["How long can I keep a book?", "Can I renew it?"])).encode()
    graft = [sys.executable, "-m", "graft_cli", "generate", "--jsonl", "-n", "10", "--stats"]
    warm, cold = (subprocess.run(graft + flags, input=lines, capture_output=True, timeout=300)
                  for flags in ([], ["--prefix-cache", "0"]))
    records = [[json.loads(line) for line in run.stdout.decode().splitlines()] for run in (warm, cold)]
    assert [r["text"] for r in records[0]] == [r["text"] for r in records[1]]
    assert records[0][1]["stats"]["cached_tokens"] > 30 and records[1][1]["stats"]["cached_tokens"] == 0
