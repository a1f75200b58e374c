"""The tiny models and test proposers the engine tests use; they live in graft_cli/synthetic.py so that
benchmarks/gpu_check.py builds the same ones without importing from tests/."""

from graft_cli.synthetic import VOCAB, OracleTreeProposer, StaticProposer, tiny_model

__all__ = ["VOCAB", "OracleTreeProposer", "StaticProposer", "tiny_model"]
