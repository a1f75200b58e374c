"""Real-model checks on the embedded default model (pulled once, then cached): few and short, but real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graft_cli.core import DraftSettings, Stats
from graft_cli.method import builder as methods
from graft_cli.runtime.engine import decode
from graft_cli.runtime.loading import encode, load_model, stop_ids
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target

pytestmark = pytest.mark.real_model

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench" / "spec_bench_question.jsonl"
CATEGORIES = ("summarization", "rag", "writing", "math_reasoning")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="module")
def prompts():
    from graft_cli.bench.datasets import resolve_dataset
    from graft_cli.core import GraftError

    try:  # shared/data beside the checkout, or $GRAFT_BENCH_DATA
        path = SPEC_BENCH if SPEC_BENCH.exists() else resolve_dataset("spec-bench")
    except GraftError:
        pytest.skip("shared/data is not beside this checkout (set GRAFT_BENCH_DATA)")
    firsts = {}
    for line in path.read_text().splitlines():
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


def bf16_report(target: str, configs: dict, prompts: list[str], n: int) -> dict:
    """Every method in ``configs`` on ``target`` in bf16 on the CPU, through the bench's runners, against ar with
    the tie-aware report (graft_cli/runtime/lossless.py); transformers' generate (hf) too."""
    from graft_cli.bench.datasets import Question
    from graft_cli.bench.execution import Conversation, execute
    from graft_cli.bench.results import summarize
    from graft_cli.bench.runners import EngineRunner, PeerRunner, shared_models
    from graft_cli.runtime.lossless import MarginTarget, report

    loaded = load_model(target, "cpu", "bfloat16")
    stop = stop_ids(loaded)
    with shared_models(loaded):
        runners = [EngineRunner(name, MarginTarget(loaded.model) if name == "ar" else Target(loaded.model),
                                      lambda c=config: methods.build(c, loaded), stop, "cpu")
                   for name, config in configs.items()]
    runners.append(PeerRunner("hf", loaded.model, stop, "cpu"))
    questions = [Question(i, "real", [p]) for i, p in enumerate(prompts)]
    records = execute(questions, runners, Conversation(loaded.tokenizer, stop), n)
    out = report(records, "bfloat16")
    summary = summarize(records, list(configs) + ["hf"], ["real"])["overall"]
    out["tau"] = {name: figures["tau"] for name, figures in summary.items()}
    print(f"\n{target} bf16 ({len(prompts)} prompts x {n} tokens): {json.dumps(out)}")
    return out


def test_bf16_every_method_matches_ar_up_to_floating_point_ties(prompts):
    """bf16 on the CPU (the dtype users run on CUDA): plain decoding and tree verification take different kernels,
    so a near-tie may flip; such a flip is a tie with its margin, any other difference fails."""
    torch.set_num_threads(2)
    small = bf16_report("smollm2-135m-instruct", {"ar": methods.MethodConfig("ar"), "pld": methods.MethodConfig("pld"),
                        "graft": methods.MethodConfig("graft")}, prompts[:1], 24)
    assert small["ok"], small["mismatches"]
    assert small["tau"]["pld"] > 1.0


def test_bf16_qwen_drafters_match_ar_up_to_floating_point_ties(prompts):
    """The Qwen drafter methods in bf16. By default the 0.5B drafts for itself: the 1.5B target takes about 8 s a
    token in bf16 on a 2-core CPU; GRAFT_BF16_TARGET=qwen2.5-coder-1.5b-instruct runs the real pair."""
    import os

    target = os.environ.get("GRAFT_BF16_TARGET", "qwen2.5-coder-0.5b-instruct")
    draft = os.environ.get("GRAFT_BF16_DRAFT", "qwen2.5-coder-0.5b-instruct")
    torch.set_num_threads(2)
    configs = {"ar": methods.MethodConfig("ar")}
    configs |= {m: methods.MethodConfig(m, draft=draft, drafting=DraftSettings(depth=4)) for m in ("dense", "pruned", "graft")}
    # writing and math: short prompts (a summary's article takes a minute to prefill in bf16 on a 2-core CPU)
    out = bf16_report(target, configs, prompts[2:], 10)
    assert out["ok"], out["mismatches"]
    assert out["tau"]["dense"] > 1.0


def test_the_shipped_head_drafts_ahead_on_the_fixed_shape_path_with_one_read_a_step(smollm2, prompts):
    """The default model with its shipped EAGLE-3 head on the fixed-shape path, the cost-aware tree planned as on
    a GPU: each draft is queued before the step's read and comes back with it; plain decoding's tokens, one read a
    step (the prefill's included), and drafts on most steps."""
    from graft_cli.drafting import LatencyModel
    from graft_cli.runtime.fixed_target import FixedShapeTarget
    from tests.test_device import decode_reading

    torch.set_num_threads(2)
    config = methods.MethodConfig("graft", budget=60, retrievers=["prompt", "recycling"],
                                  draft="eagle3:smollm2-135m-instruct-eagle3", drafting=DraftSettings(depth=7))
    ids = encode(smollm2.tokenizer, prompts[3])  # math: the head agrees often enough to draft deep
    ar, _ = generate(smollm2, "ar", ids, 64)
    target = FixedShapeTarget(smollm2.model)
    proposer = methods.build(config, smollm2, target)
    proposer.latency = proposer.objective.latency = LatencyModel.default("cuda")
    proposer.objective.planned = True
    got, reads = decode_reading(target, proposer, ids, Sampling(), 64, stop_ids(smollm2))
    assert got == ar
    assert set(reads) == {1}
    drafted = sum(1 for record in proposer.trace if record["levels"])
    assert drafted >= len(proposer.trace) // 2 and proposer.drafter.before_read


def test_bf16_with_graft_own_forward_is_token_identical_to_plain_bf16(prompts):
    """What `--dtype auto` runs where the CPU has bf16 units: graft's forward, packed bf16 linears and row-invariant
    attention, so every method gives plain bf16 decoding's tokens exactly, with no floating-point tie."""
    from graft_cli.core.cpu_units import cpu_units

    if not cpu_units().bf16:
        pytest.skip(f"no bf16 units here ({cpu_units().summary()}): bf16 is emulated, unpacked, ties allowed")
    loaded = load_model("smollm2-135m-instruct", "cpu", "bfloat16", forward="own")
    for prompt in prompts[2:]:
        ids = encode(loaded.tokenizer, prompt)
        ar, _ = generate(loaded, "ar", ids, 32)
        for method in ("pld", "graft"):
            assert generate(loaded, method, ids, 32)[0] == ar, method
