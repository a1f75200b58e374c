"""benchmarks/gpu_check.py stays runnable: without CUDA it exits 0; --smoke runs every check on the CPU with tiny
models and passes."""

import torch

from tests.scripts import load_script

METHODS = ("ar", "pld", "recycling", "rest", "dense", "pruned", "graft", "graft-tail", "eagle3")


def test_gpu_check_smoke_covers_every_method(capsys):
    gpu_check = load_script("gpu_check")
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and out.count("\n| ") == 1 + 2 * len(METHODS) + 1 + 1 + 3 + 1  # header, rows
    for name in METHODS:
        assert f"| greedy {name} (" in out and f"| sampling {name} | ok |" in out
    assert "| greedy hf (float32) | ok | 3/3 identical" in out and "| verify 16 tokens |" in out
    assert "| host ms/step |" in out
