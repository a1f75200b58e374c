"""--budget auto: the latency profile (measured once, cached), AutoBudget's cut of each tree, and generate's report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dataclasses
import time

from graft_cli.method.config import MethodConfig, parse_budget, tree_budget
from graft_cli.core.defaults import CPU, DEVICES
from graft_cli.drafting import profile
from graft_cli.drafting.budget import LatencyModel
from graft_cli.core import GraftError, Needs, Recorder, ROOT, Stats, Tree
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture


def test_parse_budget():
    assert parse_budget(None) is None
    assert parse_budget("auto") == "auto" and parse_budget(" AUTO ") == "auto"
    assert parse_budget("12") == 12
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(GraftError, match="--budget"):
            parse_budget(bad)


class _Inner:
    needs = Needs()
    drafter = None  # the contract's: a proposer with no drafter of its own

    def __init__(self, scores, clock=time.perf_counter):
        self.scores = scores
        self.observed = []
        self.recorder = Recorder(clock)

    def start(self, prompt, prefill, capacity):
        pass

    def propose(self, context):
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
    auto.recorder.begin(stats)
    tree = auto.propose([1, 2])
    assert latency.best_count(0, 0.0, inner.scores) == 3 == len(tree)
    assert [n.token for n in tree.nodes] == [10, 11, 12]
    assert auto.chosen == [3]
    assert stats.budgets == [3]


def test_auto_budget_counts_the_drafting_already_spent():
    """A step that already spent a second drafting gains more from a wider tree: keep more nodes."""
    latency = LatencyModel({1: 0.4, 2: 0.5, 4: 0.8, 8: 1.6, 16: 3.2})
    scores = [0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1]
    ticks, ticks_slow = iter([0.0, 0.0]), iter([0.0, 1.0])  # the clock the inner proposer was handed
    free = profile.AutoBudget(_Inner(scores, lambda: next(ticks)), latency)
    slow = profile.AutoBudget(_Inner(scores, lambda: next(ticks_slow)), latency)
    assert len(free.propose([1])) < len(slow.propose([1]))
    assert slow.chosen == [latency.best_count(0, 0.0, scores, overhead=1.0)]


def test_auto_budget_follows_the_cost_curve():
    inner = _Inner([0.9] * 20)
    flat = profile.AutoBudget(inner, LatencyModel({1: 1.0, 32: 1.01}))  # a GPU: width is nearly free
    steep = profile.AutoBudget(inner, LatencyModel({1: 1.0, 2: 2.0, 32: 32.0}))  # every node costs a forward
    assert len(flat.propose([1])) == 20
    assert len(steep.propose([1])) == 0


def test_a_long_context_makes_every_extra_node_dearer():
    """Past the curve's own cache each token adds to every forward and more per extra row: at 4K tokens a tree
    is cut shorter than over a few hundred, and with no per-context costs the context changes nothing."""
    latency = LatencyModel({1: 1.0, 16: 1.5, 32: 2.5}, per_context=(2e-4, 3e-5), reference=512)
    scores = [0.9, 0.8, 0.5, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05]
    short = latency.best_count(0, 0.0, scores)
    latency.context = 4096
    assert latency(1) == pytest.approx(1.0 + 3584 * 2e-4) and latency(9) == pytest.approx(latency.points[1] + 8 / 15 * 0.5 + 3584 * (2e-4 + 8 * 3e-5))
    assert latency.best_count(0, 0.0, scores) < short
    flat = LatencyModel({1: 1.0, 16: 1.5, 32: 2.5}, context=4096)
    assert flat.best_count(0, 0.0, scores) == short


# --- the latency profile -----------------------------------------------------------------------------------------
def test_profile_curve_takes_the_fastest_run_and_never_falls():
    curve, noise = profile.summarize({1: [0.1, 0.3, 0.1], 2: [0.5, 0.4, 0.6], 4: [0.2, 0.3, 0.25], 8: [0.9, 1.0, 0.9]})
    assert curve == {1: 0.1, 2: 0.4, 4: 0.4, 8: 0.9}  # a busy machine made n=2 look dearer than n=4
    assert noise == pytest.approx(0.25)


def test_profile_is_measured_once_and_cached(tiny_dir, tmp_path, monkeypatch):
    from graft_cli.runtime.loading import load_model

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(CPU, profile_sizes=(1, 2, 4, 8)))
    monkeypatch.setattr(profile, "REPEATS", 2)
    loaded = load_model(str(tiny_dir), "cpu")
    latency = profile.latency_model(loaded, quiet=True)
    assert sorted(latency.points) == [1, 2, 4, 8] and all(v > 0 for v in latency.points.values())
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and files[0].name.endswith(f"-cpu-{torch.get_num_threads()}t-float32.json")
    data = json.loads(files[0].read_text())
    assert data["latency_s"] and data["context_tokens"] == profile.CONTEXT
    assert data["per_context_s"] == [0.0, 0.0]  # the tiny model's positions stop short of LONG_CONTEXT

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(profile, "measure", boom)
    assert profile.latency_model(loaded).points == latency.points  # from the cache
    assert tree_budget(MethodConfig(budget="auto"), "cpu", max(latency.points)) == 7
    with pytest.raises(AssertionError):
        profile.latency_model(loaded, refresh=True)


def test_profile_measures_what_the_context_adds(tiny_dir, tmp_path, monkeypatch):
    from graft_cli.runtime.loading import load_model

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(CPU, profile_sizes=(1, 16)))
    monkeypatch.setattr(profile, "LONG_CONTEXT", 400)
    timings = {profile.CONTEXT: {1: [1.0], 16: [2.0]}, 400: {1: [1.8], 16: [4.3]}}
    monkeypatch.setattr(profile, "measure", lambda model, sizes, context=profile.CONTEXT, **k: timings[context])
    latency = profile.latency_model(load_model(str(tiny_dir), "cpu"), quiet=True)
    assert latency.reference == profile.CONTEXT
    assert latency.per_context == pytest.approx((0.8 / 80, 1.5 / (80 * 15)))


def test_build_auto_wraps_the_method_at_the_cap(tiny_dir, tmp_path, monkeypatch):
    from graft_cli.method import builder as methods
    from graft_cli.runtime.loading import load_model

    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setattr(profile, "measure", lambda model, sizes, **k: {n: [1.0 + n / 8] for n in (1, 2, 4, 8, 16)})
    loaded = load_model(str(tiny_dir), "cpu")
    proposer = methods.build(methods.MethodConfig("pld", "auto"), loaded)
    assert isinstance(proposer, profile.AutoBudget) and proposer.inner.budget == 15  # the cap: 16 fed, root included
    assert proposer.latency.points[16] == 3.0
    assert not isinstance(methods.build(methods.MethodConfig("ar", "auto"), loaded), profile.AutoBudget)


def test_generate_budget_auto_reports_the_chosen_budget(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path))
    monkeypatch.setitem(DEVICES, "cpu", dataclasses.replace(CPU, profile_sizes=(1, 2, 4, 8)))
    monkeypatch.setattr(profile, "REPEATS", 1)
    argv = ["generate", "--model", str(tiny_dir), "--method", "pld", "--budget", "auto", "--stats", "-n", "8",
            "--prompt", "one two three one two three one two three"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "budget auto:" in err and "nodes per step" in err
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    code, _, err = run_cli([*argv[:-2], "--budget", "many", "--prompt", "x"], capsys)
    assert code == 2 and "--budget must be 'auto'" in err


def test_one_count_and_the_curve_agree():
    """The scalar path (plain Python, asked dozens of times a step) is the array path's value at every count, and
    a replaced set of points is seen at once."""
    for latency in (LatencyModel.default("cpu"), LatencyModel({1: 1.0}),
                    LatencyModel({1: 1.0, 16: 1.5, 32: 2.5}, per_context=(2e-4, 3e-5), reference=512, context=4096)):
        for n in (0.5, 1, 2, 3, 7, 12.5, 16, 63, 64, 65, 300):
            assert latency(n) == pytest.approx(float(latency.curve(np.array([float(n)]))[0]), abs=1e-12)
    latency = LatencyModel({1: 1.0, 8: 2.0})
    assert latency.best_count(0, 0.0, [0.9, 0.9, 0.9]) == 3
    latency.points = {1: 1.0, 2: 10.0}
    assert latency(2) == 10.0 and latency.best_count(0, 0.0, [0.9, 0.9, 0.9]) == 0
