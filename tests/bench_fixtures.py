"""What the bench, --budget auto and CLI-fault tests share (no tests here): a tiny model directory and a CLI call."""

from __future__ import annotations

import pytest

from tests.test_cli import run_main


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
    """``graft ARGV`` in this process: (exit code, stdout, stderr)."""
    return run_main(argv, capsys)
