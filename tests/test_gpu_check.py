"""benchmarks/gpu_check.py stays runnable: without CUDA it exits 0; --smoke runs every check on the CPU with tiny
models and passes."""

import json

import torch

from benchmarks import gpu_check

METHODS = ("ar", "pld", "recycling", "rest", "dense", "pruned", "graft", "graft-tail", "eagle3")


def test_gpu_check_smoke_covers_every_method(capsys):
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    fixed = 12 + len(METHODS)  # the fixed-shape path's rows (benchmarks/gpu_fixed.py)
    assert "all checks passed" in out and out.count("\n| ") == 1 + 2 * len(METHODS) + 1 + 1 + 1 + 3 + 1 + 1 + fixed
    for name in METHODS:
        assert f"| greedy {name} (" in out and f"| sampling {name} | ok |" in out
        assert f"| fixed-shape {name} (float32) | ok | 3/3 token-identical" in out
    assert "| greedy hf (float32) | ok | 3/3 identical" in out and "| verify 16 tokens |" in out
    assert "| host ms/step |" in out and "| attention kernel | - |" in out and "| verify, a new shape each call |" in out
    for row in ("bandwidth", "fixed capture", "fixed plain decoding", "fixed verify 128 tokens", "fixed head level",
                "fixed draft", "fixed EAGLE-3 step", "fixed host ms/step"):
        assert f"| {row} | - |" in out


def test_a_half_precision_run_checks_greedy_again_in_fp32(tmp_path):
    """bf16's ties end what its greedy check compares; the fp32 pass that follows compares every token."""
    argv = ["--smoke", "--dtype", "bfloat16", "--skip", "sampling,latency,host,fixed", "--prompts", "1", "--new-tokens", "8",
            "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    kept = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(kept["greedy"]) == {"bfloat16", "float32"} and kept["argv"] == argv
    rows = [row[0] for row in kept["rows"]]
    assert "greedy pld (bfloat16)" in rows and "greedy pld (float32)" in rows and rows.count("flash prefill") == 1
    assert not any(row[0].startswith("sampling") for row in kept["rows"])
