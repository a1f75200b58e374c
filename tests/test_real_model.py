"""Real-model checks on the embedded default model (pulled once, then cached): few and short, but real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graft_cli import methods
from graft_cli.engine import decode
from graft_cli.loading import encode, load_model, stop_ids
from graft_cli.sampling import Sampling
from graft_cli.stats import Stats
from graft_cli.target import Target

pytestmark = pytest.mark.real_model

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench" / "spec_bench_question.jsonl"
CATEGORIES = ("summarization", "rag", "writing", "math_reasoning")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="module")
def prompts():
    if not SPEC_BENCH.exists():
        pytest.skip("shared/data is not beside this checkout")
    firsts = {}
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        firsts.setdefault(q["category"], q["turns"][0])
    return [firsts[c] for c in CATEGORIES]


def generate(loaded, method: str, ids: list[int], n: int) -> tuple[list[int], Stats]:
    stats = Stats()
    proposer = methods.build(methods.MethodConfig(method), loaded)
    steps = decode(Target(loaded.model), proposer, ids, Sampling(), n, stop_ids(loaded), None, stats)
    return [t for step in steps for t in step], stats


def test_greedy_ar_and_pld_equal_transformers_generate(smollm2, prompts):
    torch.set_num_threads(2)
    gained = 0.0
    for prompt in prompts:
        ids = encode(smollm2.tokenizer, prompt)
        with torch.inference_mode():
            hf = smollm2.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids) :]
        hf = hf.tolist()
        ar, _ = generate(smollm2, "ar", ids, 32)
        pld, stats = generate(smollm2, "pld", ids, 32)
        assert ar == hf
        assert pld == hf
        gained = max(gained, stats.tau)
    assert gained > 1.0  # prompt lookup really accepted something on these copy-heavy prompts
