"""Guards before any forward: prompt + --max-new-tokens + tree nodes against the model's positions and attention
window (refused with the numbers, or cut by --truncate), and models whose layers are not attention refused at load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config, Qwen3NextConfig

from graft_cli.runtime.engine import decode
from graft_cli.core import GraftError
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.method.config import tree_budget
from graft_cli.runtime.limits import Limits, limits
from graft_cli.method.builder import MethodConfig
from graft_cli.runtime.sampling import Sampling
from graft_cli.bench.synthetic import VOCAB, OracleTreeProposer, save_model_dir, tiny_model, word_tokenizer
from graft_cli.runtime.target import Target
from tests.test_cli import run_main

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=256)


def run_cli(argv, capsys):
    return run_main(argv, capsys)


def test_fit_refuses_with_the_numbers_or_cuts_either_end():
    lim = Limits(positions=20, window=None, model="llama")
    ids = list(range(12))
    assert lim.fit(ids, 4, 4) == ids  # 12 + 4 + 4 = 20: exactly fits
    with pytest.raises(GraftError, match=r"prompt \(12 tokens\) \+ --max-new-tokens 5 \+ tree nodes 4 = 21 positions, "
                                         r"more than the model's 20 \(max_position_embeddings\)"):
        lim.fit(ids, 5, 4)
    assert lim.fit(ids, 5, 4, "left") == ids[1:] and lim.fit(ids, 5, 4, "right") == ids[:-1]
    with pytest.raises(GraftError, match="lower --max-new-tokens"):
        lim.fit(ids, 16, 4, "left")  # not even one prompt token would fit


def test_tree_budget_is_the_methods_budget():
    assert tree_budget(MethodConfig("ar"), "cpu") == 0
    assert tree_budget(MethodConfig("pld"), "cpu") == 16 and tree_budget(MethodConfig("pld"), "cuda") == 60
    assert tree_budget(MethodConfig("graft", budget=5), "cpu") == 5
    assert tree_budget(MethodConfig("graft", budget="auto"), "cpu") == 63


@pytest.mark.parametrize("config, window", [
    (MistralConfig(**SMALL, sliding_window=32), 32),  # Mistral v0.1: every layer slides
    (MistralConfig(**SMALL, sliding_window=None), None),  # v0.2 and later
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=48, max_window_layers=1), 48),
    (Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=48), None),
    (Gemma2Config(**SMALL, sliding_window=40), 40),
    (Gemma3TextConfig(**SMALL, sliding_window=24), 24),
])
def test_sliding_windows_are_found(config, window):
    assert limits(config).window == window
    assert limits(config).positions == 256


def test_a_windowed_model_fits_inside_its_window_and_is_refused_past_it():
    lim = limits(MistralConfig(**SMALL, sliding_window=32))
    assert lim.fit(list(range(10)), 10, 11) == list(range(10))  # 31 = window - 1: the window never cuts
    with pytest.raises(GraftError, match="32-token sliding attention window of this mistral model"):
        lim.fit(list(range(10)), 10, 12)


def test_inside_its_window_a_sliding_model_verifies_trees_exactly():
    model = tiny_model("qwen2", seed=3, use_sliding_window=True, sliding_window=128, max_window_layers=0)
    assert limits(model.config).window == 128
    prompt = np.random.default_rng(0).integers(0, VOCAB, 8).tolist()
    run = lambda proposer: [t for s in decode(Target(model), proposer, prompt, Sampling(), 30, set()) for t in s]
    truth = run(GraftProposer(0))
    for seed in range(3):  # 8 + 30 + trees of at most 48 rows stay under 127
        for shape in ("random", "deep"):
            assert run(OracleTreeProposer(truth, len(prompt), seed, shape)) == truth


@pytest.mark.parametrize("config, kind", [
    (Qwen3NextConfig(**SMALL), "linear_attention"),
    (None, "mamba"),  # any layer kind that is not attention
])
def test_layers_that_are_not_attention_are_refused(config, kind):
    if config is None:
        config = MistralConfig(**SMALL)
        config.layer_types = ["full_attention", "mamba"]
    with pytest.raises(GraftError, match=f"not supported: their {kind} layers keep a recurrent state"):
        limits(config)


def test_generate_refuses_at_load_and_before_any_forward(tmp_path, capsys):
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps(Qwen3NextConfig(**SMALL).to_dict()))
    save_file({"unused": torch.zeros(1)}, str(hybrid / "model.safetensors"))  # refused before weights load
    code, _, err = run_cli(["generate", "--model", str(hybrid), "--prompt", "t1 t2"], capsys)
    assert code == 2 and err.count("\n") == 1 and "qwen3_next models are not supported" in err

    small = save_model_dir(tmp_path / "small", tiny_model(seed=1, max_position_embeddings=40), word_tokenizer())
    prompt = " ".join(f"t{i % VOCAB}" for i in range(1, 31))  # 30 tokens
    argv = ["generate", "--model", str(small), "--raw", "--prompt", prompt, "--method", "ar", "-n", "12"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "prompt (30 tokens) + --max-new-tokens 12 + tree nodes 0 = 42 positions, more than the model's 40" in err
    code, cut, err = run_cli(argv + ["--truncate", "left"], capsys)
    assert code == 0, err
    code, same, err = run_cli(argv[:5] + [" ".join(prompt.split()[2:])] + argv[6:], capsys)  # the last 28 by hand
    assert code == 0 and cut == same
    code, _, err = run_cli(argv + ["--truncate", "middle"], capsys)
    assert code == 2 and "--truncate must be left or right" in err


def test_bench_checks_every_question_before_any_forward():
    from graft_cli.bench.datasets import Question
    from graft_cli.bench.execution import Conversation, check_reach

    conv = Conversation(word_tokenizer(), set())
    lim = Limits(positions=40, window=None, model="llama")
    short, long = Question(1, "a", ["t1 t2 t3"]), Question(7, "a", ["t1 t2 t3", "t4 t5"])
    check_reach([short], conv, lim, 20, 10)  # 3 + 20 + 10 fits in 40
    with pytest.raises(GraftError, match=r"question 7 \(earlier answers counted at --max-new-tokens each\): prompt"):
        check_reach([short, long], conv, lim, 20, 10)  # 5 + 20 (first answer) + 20 + 10 does not
