"""The Python API: the same text as `graft generate` for the same settings, streams that join to it, stop strings,
system prompts, one generation at a time, and a process left as it was; the command line's new habits."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

import graft_cli
from graft_cli.core import GraftError
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture

PROMPT = "one two three one two three one two"


@pytest.fixture(scope="module")
def generator(tiny_dir):
    with graft_cli.load(str(tiny_dir), method="graft", device="cpu") as g:
        yield g


def cli_text(argv, capsys) -> str:
    code, out, err = run_cli(["generate", *argv], capsys)
    assert code == 0, err
    return out.removesuffix("\n")


@pytest.mark.parametrize("settings, flags", [
    ({}, []),
    ({"temperature": 0.8, "seed": 3}, ["--temperature", "0.8", "--seed", "3"]),
    ({"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 5}, ["-t", "1", "--top-p", "0.9", "--top-k", "20", "--seed", "5"]),
])
def test_the_api_gives_the_text_graft_generate_gives(generator, tiny_dir, capsys, settings, flags):
    completion = generator.generate(PROMPT, max_new_tokens=24, **settings)
    assert completion.text == cli_text([PROMPT, "--model", str(tiny_dir), "-n", "24", "--device", "cpu", *flags], capsys)
    assert completion.prompt_tokens > 0 and 0 < len(completion.token_ids) <= 24
    assert completion.finish_reason in ("stop", "length") and completion.stats.new_tokens == len(completion.token_ids)
    assert completion.stats.tau >= 1.0 and completion.stats.as_dict()["steps"] == completion.stats.steps


def test_stream_pieces_join_to_the_completion(generator):
    whole = generator.generate(PROMPT, max_new_tokens=30, temperature=0.7, seed=11)
    stream = generator.stream(PROMPT, max_new_tokens=30, temperature=0.7, seed=11)
    pieces = list(stream)
    assert "".join(p.text for p in pieces) == whole.text == stream.completion.text
    assert stream.completion.token_ids == whole.token_ids


def test_every_method_gives_plain_decodings_text(tiny_dir):
    texts = set()
    for method in ("ar", "pld", "recycling", "graft"):
        with graft_cli.load(str(tiny_dir), method=method, device="cpu") as g:
            texts.add(g.generate(PROMPT, max_new_tokens=24).text)
    assert len(texts) == 1


def test_a_stop_string_ends_the_text_before_it(generator):
    full = generator.generate(PROMPT, max_new_tokens=30)
    words = full.text.split()
    assert len(words) > 2, full.text
    stop = words[2]
    cut = generator.generate(PROMPT, max_new_tokens=30, stop=[stop, "never there"])
    assert cut.text == full.text[: full.text.find(stop)] and cut.finish_reason == "stop"
    pieces = "".join(p.text for p in generator.stream(PROMPT, max_new_tokens=30, stop=[stop]))
    assert pieces == cut.text  # no piece of the stop string was streamed first


def test_messages_and_a_system_prompt(generator, tiny_dir, capsys):
    messages = [{"role": "user", "content": PROMPT}]
    assert generator.generate(messages=messages, max_new_tokens=12).text == generator.generate(PROMPT, max_new_tokens=12).text
    with_system = generator.generate(PROMPT, system="Answer briefly.", max_new_tokens=12)
    same = generator.generate(messages=[{"role": "system", "content": "Answer briefly."}, *messages], max_new_tokens=12)
    assert with_system.text == same.text
    assert with_system.text == cli_text([PROMPT, "--system", "Answer briefly.", "--model", str(tiny_dir), "-n", "12",
                                         "--device", "cpu"], capsys)
    for bad, message in [(dict(), "a prompt or messages"), (dict(prompt=PROMPT, messages=messages), "one of them"),
                         (dict(messages=[]), "non-empty list"), (dict(prompt=PROMPT, system="x", raw=True), "chat template"),
                         (dict(prompt=PROMPT, stop=[""]), "stop string"), (dict(prompt=PROMPT, max_new_tokens=0), "at least 1")]:
        prompt = bad.pop("prompt", None)
        with pytest.raises(GraftError, match=message):
            generator.generate(prompt, **bad)


def test_one_generation_at_a_time(generator):
    stream = generator.stream(PROMPT, max_new_tokens=20)
    next(stream)
    with pytest.raises(GraftError, match="already generating"):
        generator.generate(PROMPT, max_new_tokens=4)
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_error(lambda: generator.generate(PROMPT, max_new_tokens=4))))
    worker.start()
    worker.join()
    assert "already generating" in errors[0]
    stream.close()  # closing frees it
    assert generator.generate(PROMPT, max_new_tokens=4).text


def _error(call) -> str:
    try:
        call()
    except GraftError as e:
        return str(e)
    return ""


def test_loading_and_generating_leave_the_process_as_it_was(tiny_dir):
    code = f"""
import json, os
import torch, transformers
from transformers import AutoModelForCausalLM, modeling_utils
from transformers.utils import logging
before = (dict(os.environ), logging.get_verbosity(), logging.is_progress_bar_enabled())
import graft_cli
g = graft_cli.load({str(tiny_dir)!r}, method="graft", device="cpu")
text = g.generate("one two three", max_new_tokens=8).text
g.close()
after = (dict(os.environ), logging.get_verbosity(), logging.is_progress_bar_enabled())
print(json.dumps({{"same": before == after, "text": bool(text)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "text": True}


def test_load_refuses_bad_settings_before_the_model_loads():
    with pytest.raises(GraftError, match="unknown method"):
        graft_cli.load("nowhere/at-all", method="bogus")
    with pytest.raises(GraftError, match="one datastore"):
        graft_cli.load("nowhere", datastores=["a", "b"])
    with pytest.raises(GraftError, match="unexpected keyword argument 'depht'"):
        graft_cli.load("nowhere", depht=3)


def test_command_line_habits(tiny_dir, capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"graft {graft_cli.__version__}"
    base = ["--model", str(tiny_dir), "-n", "16", "--device", "cpu"]
    assert cli_text([PROMPT, *base], capsys) == cli_text(["--prompt", PROMPT, *base], capsys)
    assert cli_text([PROMPT, "--method", "ngram", *base], capsys) == cli_text([PROMPT, "--method", "pld", *base], capsys)
    full = cli_text([PROMPT, *base], capsys)
    stop = full.split()[1]
    assert cli_text([PROMPT, "--stop", "zzz", "--stop", stop, *base], capsys) == full[: full.find(stop)]
    code, _, err = run_cli(["generate", PROMPT, "--prompt", PROMPT, *base], capsys)
    assert code == 2 and err.count("\n") == 1 and "give the prompt once" in err


def test_the_eagle3_alias_drafts_with_a_head(tmp_path):
    from graft_cli.method.config import MethodConfig

    config = MethodConfig("eagle3", draft="some-head")
    assert (config.method, config.draft) == ("dense", "eagle3:some-head")
    assert MethodConfig("eagle3", draft="eagle3:x").draft == "eagle3:x"
    assert MethodConfig("ngram").method == "pld"


@pytest.mark.real_model
def test_the_default_model_through_the_api_and_the_command(capsys):
    prompt = "Write a Python function that adds two numbers."
    with graft_cli.load() as g:
        greedy = g.generate(prompt, max_new_tokens=32)
        sampled = g.generate(prompt, max_new_tokens=32, temperature=0.7, seed=4)
    assert greedy.text == cli_text([prompt, "-n", "32"], capsys)
    assert sampled.text == cli_text([prompt, "-n", "32", "-t", "0.7", "--seed", "4"], capsys)
