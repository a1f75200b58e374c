"""--device-map: a model sharded by accelerate (layers placed by a device map, some offloaded to disk) verifies
trees and compacts its KV cache exactly as the unsharded model does (on the CPU here; GPUs in gpu_check.py)."""

from __future__ import annotations

import numpy as np
import pytest

from graft_cli.runtime.engine import decode
from graft_cli.core import GraftError
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.loading import load_model, parse_device_map
from graft_cli.runtime.sampling import Sampling
from graft_cli.bench.synthetic import VOCAB, OracleTreeProposer, save_model_dir, tiny_model, word_tokenizer
from graft_cli.runtime.target import Target

PLACED = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
          "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("sharded") / "tiny", tiny_model("llama", seed=2), word_tokenizer())


def tokens(model, proposer, prompt, n=40):
    return [t for step in decode(Target(model), proposer, prompt, Sampling(), n, set()) for t in step]


@pytest.mark.parametrize("device_map", [PLACED, PLACED | {"model.layers.1": "disk", "lm_head": "disk"}, "auto"],
                         ids=["layers-on-cpu", "disk-offload", "auto"])
def test_a_sharded_model_is_greedy_identical_to_the_whole_one(model_dir, device_map):
    whole = load_model(str(model_dir), "cpu", "float32")
    sharded = load_model(str(model_dir), "cpu", "float32", device_map=device_map)
    assert sharded.device == "cpu"
    if "disk" in str(device_map):  # really offloaded: weights on meta, read from disk by accelerate's hooks
        assert any(p.device.type == "meta" for p in sharded.model.parameters())
        assert sharded.model.hf_device_map["lm_head"] == "disk"
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 10).tolist()
        truth = tokens(whole.model, GraftProposer(0), prompt)
        assert tokens(sharded.model, GraftProposer(0), prompt) == truth
        for shape in ("deep", "random"):
            assert tokens(sharded.model, OracleTreeProposer(truth, len(prompt), seed, shape), prompt) == truth


def test_bad_device_maps_are_one_line_errors():
    assert parse_device_map('{"model": "cpu"}') == {"model": "cpu"}
    assert parse_device_map("balanced") == "balanced"
    for text, message in (("everywhere", "unknown --device-map"), ("{nope", "invalid JSON"), ("{}", "JSON object")):
        with pytest.raises(GraftError, match=message):
            parse_device_map(text)


def test_generate_with_a_device_map_prints_the_same_text(model_dir, capsys):
    import json

    from tests.test_cli import run_main

    argv = ["generate", "--model", str(model_dir), "--raw", "--prompt", "t1 t2 t3 t1 t2", "--method", "pld", "-n", "12"]
    code, whole, err = run_main(argv, capsys)
    assert code == 0, err
    offload = json.dumps(PLACED | {"model.layers.0": "disk"})
    code, sharded, err = run_main(argv + ["--device-map", offload], capsys)
    assert code == 0 and sharded == whole, err
    code, _, err = run_main(argv + ["--device-map", "everywhere"], capsys)
    assert code == 2 and "unknown --device-map" in err
