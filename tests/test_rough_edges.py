"""What a new user meets first: escapes in --stop, GRAFT_DEBUG keeping the exit code, a closed Generator, the
whole message of a bad JSONL line, one Input panel in the help."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

import graft_cli
from graft_cli.cli.escapes import unescape
from graft_cli.core import GraftError
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture

PROMPT = "one two three one two three one two"


@pytest.mark.parametrize("typed, meant", [
    (r"\n\n", "\n\n"), (r"a\tb", "a\tb"), (r"\x41\\n", "A\\n"), (r"C:\path", "C:\\path"), ("é\\n", "é\n"),
    ("\\", "\\"), (r"\"q\'", "\"q'"),
])
def test_escapes_read_as_llama_cpp_reads_them(typed, meant):
    assert unescape(typed) == meant


def test_a_stop_string_given_with_escapes_matches(tiny_dir, capsys):
    with graft_cli.load(str(tiny_dir), method="ar", device="cpu") as g:
        full = g.generate(PROMPT, max_new_tokens=30).text
        stop = full.split()[2]
        cut = g.generate(PROMPT, max_new_tokens=30, stop=[stop]).text
    escaped = "".join(f"\\x{ord(c):02x}" if ord(c) < 128 else c for c in stop)  # what a shell would pass
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_dir), "--method", "ar", "-n", "30",
                              "--device", "cpu", "--stop", escaped], capsys)
    assert code == 0, err
    assert out.removesuffix("\n") == cut and len(cut) < len(full)


def test_a_closed_generator_refuses_to_generate(tiny_dir):
    g = graft_cli.load(str(tiny_dir), method="graft", device="cpu")
    assert g.generate(PROMPT, max_new_tokens=4).text
    g.close()
    g.close()  # a second close does nothing
    for call in (lambda: g.generate(PROMPT, max_new_tokens=4), lambda: g.stream(PROMPT, max_new_tokens=4)):
        with pytest.raises(GraftError, match="closed"):
            call()


def test_a_bad_jsonl_line_says_where(tiny_dir, capsys, monkeypatch):
    lines = b'{"id": "a", "prompt": "one two"}\n{"id": "b", "prompt": "one\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    code, out, err = run_cli(["generate", "--jsonl", "--model", str(tiny_dir), "-n", "4", "--device", "cpu"], capsys)
    assert code == 2
    error = [json.loads(line) for line in out.splitlines()][1]["error"]
    assert error == "invalid JSON: Unterminated string starting at column 23"
    assert f"line 2: {error}" in err


def test_graft_debug_keeps_exit_code_2_and_shows_the_traceback():
    env = dict(os.environ, GRAFT_DEBUG="1")
    run = subprocess.run([sys.executable, "-m", "graft_cli", "generate", "--prompt", "   "], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" in run.stderr and run.stderr.rstrip().endswith("graft: error: the prompt is empty")


def test_generate_help_has_one_input_panel(capsys):
    code, out, _ = run_cli(["generate", "--help"], capsys)
    assert code == 0
    assert sum(1 for line in out.splitlines() if "─ Input " in line) == 1
