"""Threads: --threads and ``load(threads=...)`` set torch's count for the process, the default is the cores the
process may use, and the command line makes OpenMP's threads sleep while they wait unless the user said otherwise."""

from __future__ import annotations

import os

import pytest
import torch

import graft_cli
from graft_cli.core import GraftError
from graft_cli.core.threads import available_cores, sleep_while_waiting, use_threads
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture


def test_the_default_is_the_cores_the_process_may_use(monkeypatch):
    assert available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert use_threads(None) == available_cores() == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting wins
    assert use_threads(None) == 1 == torch.get_num_threads()
    assert use_threads(1) == 1 == torch.get_num_threads()
    with pytest.raises(GraftError, match="at least 1"):
        use_threads(0)


def test_load_and_generate_take_threads(tiny_dir, capsys):
    with graft_cli.load(str(tiny_dir), method="ar", device="cpu", threads=1) as g:
        assert torch.get_num_threads() == 1
        text = g.generate("one two three", max_new_tokens=6).text
    code, out, err = run_cli(["generate", "one two three", "--model", str(tiny_dir), "--method", "ar", "-n", "6",
                              "--device", "cpu", "--threads", "2"], capsys)
    assert code == 0 and torch.get_num_threads() == 2 and out.removesuffix("\n") == text  # same text, any count
    code, _, err = run_cli(["serve", "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err


def test_threads_sleep_while_waiting_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    sleep_while_waiting()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    sleep_while_waiting()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
