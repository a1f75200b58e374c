"""graft_cli/api/capture_check.py: the captured path checked against the eager one at first use, on a CPU through
a stand-in capture (graft_cli.bench.synthetic.ReplayCapture): a faithful one passes and its verdict is kept beside
the latency profile, so it costs once; a broken one (its replays write the wrong buffer) is caught, the captured
path switched off with one line, and the Generator goes on eagerly with the eager path's text."""

from __future__ import annotations

import json

import pytest

import graft_cli
from graft_cli.api import capture_check, generator as generator_module
from graft_cli.bench.synthetic import ReplayCapture, save_model_dir, tiny_model, word_tokenizer
from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.runtime.fixed_target import FixedShapeTarget, make_target
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.target import Target


@pytest.fixture
def loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    folder = save_model_dir(tmp_path / "tiny", tiny_model(seed=4, layers=2, max_position_embeddings=512),
                            word_tokenizer())
    return load_model(str(folder), "cpu", "float32")


def captured_target(loaded, capture) -> FixedShapeTarget:
    return FixedShapeTarget(loaded.model, capture=capture)


@pytest.mark.parametrize("method", ["ar", "graft"])
def test_a_faithful_capture_passes_once_and_its_verdict_is_kept(loaded, method, monkeypatch, capsys):
    config = configure(method, curve="cpu")
    capture = ReplayCapture()
    target = captured_target(loaded, capture)
    verdict = capture_check.first_use(loaded, config, target, methods.build(config, loaded, target))
    assert verdict.ok and verdict.tokens == capture_check.NEW_TOKENS and not verdict.ties and capture.replays > 0
    path = capture_check.verdict_path(loaded, config)
    assert path.parent.name == "profiles" and path.name.endswith(".json") and "-captured-" + method in path.name
    assert json.loads(path.read_text())["ok"] is True and capsys.readouterr().err == ""

    def no_second_check(*args, **kwargs):
        raise AssertionError("checked again")

    monkeypatch.setattr(capture_check, "check", no_second_check)
    again = captured_target(loaded, ReplayCapture())
    assert capture_check.first_use(loaded, config, again, methods.build(config, loaded, again)) == verdict
    eager = Target(loaded.model)
    assert capture_check.first_use(loaded, config, eager, methods.build(config, loaded, eager)) is None


def test_a_capture_that_writes_the_wrong_buffer_is_caught_and_kept(loaded, capsys):
    config = configure("graft", curve="cpu")
    target = captured_target(loaded, ReplayCapture(wrong_buffer=True))
    verdict = capture_check.first_use(loaded, config, target, methods.build(config, loaded, target))
    assert not verdict.ok and ("differs from the eager path's" in verdict.reason or "failed" in verdict.reason)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft: warning: the captured path is off for graft")
    kept = capture_check.read_verdict(capture_check.verdict_path(loaded, config))
    assert kept == verdict  # the next start goes eager at once


def test_a_verdict_of_another_version_is_checked_again(loaded):
    config = configure("pld", curve="cpu")
    path = capture_check.verdict_path(loaded, config)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**capture_check.asdict(capture_check.Verdict(False, "old", "pld", 48, 1.0)),
                                "torch": "1.0"}))
    assert capture_check.read_verdict(path) is None
    path.write_text("{not json")
    assert capture_check.read_verdict(path) is None


def test_the_generator_goes_on_eagerly_when_the_check_fails(loaded, monkeypatch, capsys):
    prompt = "t5 t9 t5 t9 t5 t9 t3"
    with graft_cli.load(str(loaded.path), method="graft", device="cpu", graphs="off") as plain:
        want = plain.generate(prompt, max_new_tokens=24, raw=True).text

    def broken(model, switch="auto", *args, **kwargs):
        if switch == "on":
            return FixedShapeTarget(model, capture=ReplayCapture(wrong_buffer=True))
        return make_target(model, switch, *args, **kwargs)

    monkeypatch.setattr(generator_module, "make_target", broken)
    with graft_cli.load(str(loaded.path), method="graft", device="cpu", graphs="on") as generator:
        assert type(generator.target) is Target  # switched off for this key
        assert generator.generate(prompt, max_new_tokens=24, raw=True).text == want
    assert capsys.readouterr().err.count("the captured path is off") == 1
