"""benchmarks/gpu_check.py stays runnable: without CUDA it exits 0; its checks run on the CPU with a tiny shape."""

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs(capsys):
    gpu_check = load()
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--device", "cpu", "--shape", "tiny", "--sizes", "1,4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "16/16 runs token-identical" in out and "| 4 |" in out
