"""benchmarks/step_trace.py's figure of merit: one shared cost curve, per method and per category."""

import json

from tests.scripts import load_script


def _write(path, steps):
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))


def _step(nodes, tokens, step_s=0.1, **label):
    return {**label, "nodes": nodes, "verify_s": step_s, "step_s": step_s, "tokens": tokens, "retrievers": 1}


def test_merit_per_category_against_the_other_methods(tmp_path, capsys):
    trace = load_script("step_trace")
    ref = tmp_path / "ref.jsonl"
    # 0-node steps cost 0.1 s, 4-node steps 0.2 s; the first step has no label (a warm-up) and is left out
    _write(ref, [_step(0, 1), _step(0, 1, method="pld", category="a"), _step(4, 3, 0.2, method="pld", category="a"),
                 _step(0, 1, method="pld", category="b"), _step(4, 2, 0.2, method="graft", category="a"),
                 _step(4, 4, 0.2, method="graft", category="b")])
    variant = tmp_path / "var.jsonl"
    _write(variant, [_step(4, 4, 0.3, method="graft", category="a"), _step(4, 1, 0.3, method="graft", category="b")])
    trace.merit(str(ref), [str(ref), str(variant)])
    out = capsys.readouterr().out
    assert "ref.jsonl pld: 3 steps, tau 1.667" in out and "merit 12.50 tok/s" in out  # 5 tokens over 0.4 s
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[-2:]}
    # columns: ref/graft, ref/pld, var/graft; each graft is judged against pld alone, never against the other graft
    assert rows["a"] == ["10.00", "0.750", "13.33", "0.667", "20.00", "1.500"]
    assert rows["b"] == ["20.00", "2.000", "10.00", "0.500", "5.00", "0.500"]


def test_an_unlabelled_trace_groups_by_retriever_count(tmp_path, capsys):
    trace = load_script("step_trace")
    old = tmp_path / "old.jsonl"
    _write(old, [_step(0, 1), _step(4, 3, 0.2)])
    trace.merit(str(old), [str(old)])
    out = capsys.readouterr().out
    assert "retrievers=1: 2 steps, tau 2.000" in out and "per category" not in out


def test_own_host_charges_each_step_its_own_host_time(tmp_path, capsys):
    """The curve from verification alone; a method's slower host work counts against it, not against every method."""
    trace = load_script("step_trace")
    ref = tmp_path / "ref.jsonl"
    slow = {**_step(0, 2, 0.1, method="slow", category="a"), "step_s": 0.15}  # 50 ms of host work
    _write(ref, [_step(0, 2, 0.1, method="fast", category="a"), slow])
    trace.merit(str(ref), [str(ref)], own_host=True)
    out = capsys.readouterr().out
    assert "fast: 1 steps, tau 2.000, nodes 0.00, merit 20.00 tok/s" in out  # 2 tokens / 0.1 s
    assert "slow: 1 steps, tau 2.000, nodes 0.00, merit 13.33 tok/s" in out  # 2 tokens / (0.1 + 0.05) s
