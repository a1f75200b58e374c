"""The compiled path (``--graphs compiled``, graft_cli/runtime/compiled.py) on a CPU, under the stand-in capture
(each replay runs the region again): every method's tokens equal the eager path's, greedy and seeded; each keyed
region compiles during its warm-up and never again, over a request and across requests; a compilation that fails
leaves the path as it was, with one line on stderr.

The tiny-model test compiles with ``aot_eager`` (dynamo's tracing and AOT's functionalization, no code
generation: seconds) so that every method fits; the real-model test compiles with inductor (C++ through gcc), on
the default model, for plain decoding only: its three compilations (the 30-layer verification, two acceptances)
are the slowest part of this file (gcc through inductor; minutes on a shared 2-core CPU).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from graft_cli.bench.runners import shared_models
from graft_cli.bench.synthetic import ReplayCapture, method_configs, synthetic_models, text_store
from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.runtime.compiled import Compiler, Compiling
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget, make_target, use_compiler
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from tests.tiny import tiny_model

SAMPLINGS = {"greedy": (Sampling(), None), "seeded": (Sampling(temperature=0.8, top_k=8, top_p=0.95), 5)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tokens(target: Target, proposer, prompt: list[int], sampling: Sampling, seed: int | None, n: int) -> list[int]:
    return [t for step in decode(target, proposer, prompt, sampling, n, set(), seed) for t in step]


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    target_dir, head_dir = synthetic_models(root, layers=3)
    loaded = load_model(str(target_dir), "cpu", "float32")
    prompt = [5, 9, 13, 21, 5, 9, 13, 30, 44, 5, 9]
    store = text_store(root, target_dir, [" ".join(f"t{t}" for t in prompt * 3)])
    return loaded, method_configs(target_dir, head_dir, store, 4), prompt


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLINGS.keys())
def test_every_method_compiled_gives_the_eager_tokens_and_compiles_once(synthetic, sampling):
    loaded, configs, prompt = synthetic
    how, seed = SAMPLINGS[sampling]
    with shared_models(loaded):
        for name, config in configs.items():
            config = replace(config, curve="cpu")
            eager = tokens(Target(loaded.model), methods.build(config, loaded), prompt, how, seed, 16)
            compiler = Compiler("aot_eager")
            target = FixedShapeTarget(loaded.model, capture=Compiling(ReplayCapture(), compiler))
            shapes: set = set()
            for _ in range(2):  # two requests: the second compiles only the shapes the first did not meet
                proposer = methods.build(config, loaded, target)
                assert tokens(target, proposer, prompt, how, seed, 16) == eager, name
                shapes |= {key[:2] for key in target.graphs.calls}
                if proposer.drafter is not None:
                    shapes |= {key[:2] for key in proposer.drafter.fixed.graphs.calls}
            assert compiler.broken is None and compiles() == len(shapes) > 0, name  # once per shape, no recompile
            torch._dynamo.reset()
            counters.clear()
            torch._dynamo.reset()
            counters.clear()


def test_a_compilation_that_fails_runs_uncompiled_with_one_line(synthetic, capsys):
    loaded, configs, prompt = synthetic

    def failing(graph, example_inputs):
        raise RuntimeError("no compiler here\nmore detail")

    config = replace(configs["eagle3"], curve="cpu")
    with shared_models(loaded):
        eager = tokens(Target(loaded.model), methods.build(config, loaded), prompt, Sampling(), None, 16)
        compiler = Compiler(failing)
        target = FixedShapeTarget(loaded.model, capture=Compiling(ReplayCapture(), compiler))
        assert tokens(target, methods.build(config, loaded, target), prompt, Sampling(), None, 16) == eager
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and compiler.broken is not None
    assert lines[0].startswith("graft: ") and "runs uncompiled" in lines[0] and "more detail" not in lines[0]


def test_the_switch():
    assert use_compiler("compiled", "cpu") and use_compiler("compiled", "cuda")
    assert not use_compiler("on", "cuda") and not use_compiler("off", "cuda") and not use_compiler("auto", "cpu")
    target = make_target(tiny_model(), "compiled")
    assert isinstance(target, FixedShapeTarget) and target.graphs.compiler is not None


@pytest.mark.real_model
def test_the_default_model_compiled_by_inductor_gives_the_eager_tokens():
    """Plain decoding, greedy then seeded, two requests each: the same tokens as the eager path, each region
    compiled once (verification, and an acceptance per sampling) and never again."""
    loaded = load_model("smollm2-135m-instruct", device="cpu")
    prompt = loaded.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    compiler = Compiler()
    target = FixedShapeTarget(loaded.model, capture=Compiling(ReplayCapture(), compiler), buckets=(1,))
    ar = methods.build(configure("ar"), loaded)
    for how, seed in SAMPLINGS.values():
        eager = tokens(Target(loaded.model), ar, prompt, how, seed, 8)
        assert tokens(target, ar, prompt, how, seed, 8) == eager
        first = compiles()
        assert tokens(target, ar, prompt, how, seed, 8) == eager and compiles() == first
    assert compiler.broken is None and compiles() == 3  # verify, accept greedy, accept sampled
