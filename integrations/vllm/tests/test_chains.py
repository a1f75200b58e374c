"""The proposer's parts without an engine: settings, requests recognised by their tokens, chains cut by their
estimates, per-request state, the response cache across requests, and the vLLM 0.34 adapter over stand-ins."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from graft_cli.plugin import GraftError
from graft_vllm import registers_methods, speculative_config
from graft_vllm.chains import ChainProposer
from graft_vllm.rows import Rows
from graft_vllm.settings import Settings, read

VOCAB = 100
TEXT = [5, 6, 7, 8, 9, 10, 11, 12]


def proposer(retrievers: str = "prompt", min_score: float = 0.0, limit: int = 4, **env: str) -> ChainProposer:
    settings = read({"GRAFT_VLLM_RETRIEVERS": retrievers, "GRAFT_VLLM_MIN_SCORE": str(min_score), **env})
    return ChainProposer(settings, VOCAB, None, limit, max_len=64)


def test_settings_from_environment_and_file(tmp_path):
    file = tmp_path / "graft.toml"
    file.write_text('retrievers = ["prompt", "responses"]\nmin_score = 0.5\n[options]\n"prompt.max_match" = 4\n')
    settings = read({"GRAFT_VLLM_CONFIG": str(file), "GRAFT_VLLM_MIN_SCORE": "0.25"})
    options = {"prompt.min_match": "2", "prompt.periodic": "1", "prompt.max_match": "4"}
    assert settings == Settings(("prompt", "responses"), options, 0.25, 1.0, 2.0, 32)
    assert read({"GRAFT_VLLM_DATASTORE": "docs"}).retrievers == ("prompt", "responses", "suffix-array")
    assert read({"GRAFT_VLLM_DATASTORE": "docs"}).options == {
        "prompt.min_match": "2", "prompt.periodic": "1", "suffix-array.min_match": "6", "datastore": "docs"}


def test_shortest_matches_default_per_named_retriever_and_give_way():
    assert read({"GRAFT_VLLM_RETRIEVERS": "responses"}).options == {}  # no default a retriever would not read
    given = read({"GRAFT_VLLM_RETRIEVERS": "prompt", "GRAFT_VLLM_OPTIONS": "prompt.min_match=1"})
    assert given.options == {"prompt.min_match": "1", "prompt.periodic": "1"}


@pytest.mark.parametrize("environ, message", [
    ({"GRAFT_VLLM_MIN_SCORE": "high"}, "min_score must be a float"),
    ({"GRAFT_VLLM_MIN_SCORE": "2"}, "between 0 and 1"),
    ({"GRAFT_VLLM_MIN_EXPECTED": "-1"}, "at least 0"),
    ({"GRAFT_VLLM_OPTIONS": "max_match"}, "is not KEY=VALUE"),
    ({"GRAFT_VLLM_CONFIG": "/nonexistent/graft.toml"}, "cannot read"),
])
def test_bad_settings_are_one_line(environ, message):
    with pytest.raises(GraftError, match=message):
        read(environ)


def test_unknown_retriever_and_unread_option_stop_at_start():
    with pytest.raises(GraftError, match="unknown retriever 'nope'"):
        proposer("prompt,nope")
    with pytest.raises(GraftError, match="no retriever reads the option 'max_mach'"):
        proposer(GRAFT_VLLM_OPTIONS="max_mach=3")


def test_version_chooses_the_interface():
    assert speculative_config(5, installed=(0, 32))["model"] == "graft_vllm.custom_class.GraftProposer"
    assert speculative_config(5, installed=(0, 34)) == {"method": "graft", "num_speculative_tokens": 5}
    assert registers_methods((0, 35)) and not registers_methods((0, 33))
    with pytest.raises(RuntimeError, match="0.32 or later"):
        speculative_config(5, installed=(0, 31))


def test_prompt_chain_accepted_and_counted():
    chains = proposer(limit=4)
    prompt = TEXT + [1, 2, 5]  # the text, then its first token again
    assert chains.start("a", prompt, [6]) == [7, 8, 9, 10]  # what followed 5, 6 in the prompt
    assert chains.step("a", [7, 8, 3]) == []  # two accepted, then the target's own token: nothing follows 8, 3
    assert (chains.counts.drafts, chains.counts.drafted, chains.counts.accepted) == (1, 4, 2)


def test_min_score_cuts_the_chain_and_min_expected_withholds_it():
    chains = proposer(min_score=0.99)
    assert chains.start("a", TEXT + [5], [6]) == []  # one earlier match: not sure enough for 0.99
    assert proposer(GRAFT_VLLM_MIN_EXPECTED="4.5").start("a", TEXT + [5], [6]) == []  # 4 tokens cannot add 4.5
    assert proposer(GRAFT_VLLM_MIN_EXPECTED="1").start("a", TEXT + [5], [6]) == [7, 8, 9, 10]


def test_a_step_of_several_requests_sets_the_batched_bar():
    """One request alone is held to ``min_expected``, a step of several to ``min_expected_batched``."""
    chains = proposer(GRAFT_VLLM_MIN_EXPECTED="1", GRAFT_VLLM_MIN_EXPECTED_BATCHED="4.5")
    chains.batch(1)
    assert chains.start("a", TEXT + [5], [6]) == [7, 8, 9, 10]
    chains.batch(8)
    assert chains.start("b", TEXT + [5], [6]) == []  # 4 tokens cannot add 4.5


def test_a_loop_is_drafted_past_the_context_end():
    """The model has begun to repeat itself: the chain goes on round the loop, where it would stop at the
    context's end (and then, expected to add too little, not be sent)."""
    loop = [9, 1, 2, 1, 2]
    assert proposer(limit=6).start("a", loop, [1]) == [2, 1, 2, 1, 2, 1]
    assert proposer(limit=6, GRAFT_VLLM_OPTIONS="prompt.periodic=0").start("a", loop, [1]) == [2, 1]


def test_requests_make_their_retrievers_without_looking_for_plugins(monkeypatch):
    """Plugins are found once, at start-up: finding one reads every installed distribution's entry points,
    milliseconds a new request must not pay."""
    from graft_cli.core import discovery

    chains = proposer("prompt,responses")

    def never(*args, **kwargs):
        raise AssertionError("a plugin was looked up for a request")

    monkeypatch.setattr(discovery, "entry_points", never)
    assert chains.start("a", TEXT + [5], [6]) == [7, 8, 9, 10]
    assert chains.start("b", [40, 41, 42, 43, 44, 40], [41]) == [42, 43, 44, 40]


def test_state_is_per_request_and_freed():
    chains = proposer()
    chains.start("a", TEXT + [5], [6])
    assert chains.start("b", [40, 41, 42, 43, 44, 40], [41]) == [42, 43, 44, 40]  # b's own prompt, nothing of a's
    chains.finish("a")
    assert "a" not in chains and "b" in chains


def test_response_cache_serves_later_requests():
    chains = proposer("prompt,responses", limit=6)
    answer = [20, 21, 22, 23, 24, 25, 26]
    chains.start("a", [1, 2, 3], answer[:1])
    chains.step("a", answer[1:])
    chains.finish("a")  # the response joins the shared index
    assert chains.start("b", [1, 2, 3], answer[:1]) == answer[1:]  # the same question: the earlier answer
    assert "a" not in chains


def test_rows_follow_requests_by_their_tokens():
    rows = Rows()
    first = np.array([1, 2, 3, 4, 0, 0])
    second = np.array([7, 8, 9, 0, 0, 0])
    a, new_a = rows.claim(0, first, 4, 1)
    b, new_b = rows.claim(1, second, 3, 1)
    assert new_a and new_b and rows.gone() == []
    second[3:5] = [10, 11]  # b moved to row 0 after a finished, and grew by two
    assert rows.claim(0, second, 5, 2) == (b, False)
    assert rows.gone() == [a]


def stand_in_vllm(monkeypatch):
    """vLLM 0.34's two base classes, for the adapter where only an older vLLM installs."""
    for name, cls in (("speculator", "BaseSpeculator"), ("speculator_config", "SpeculatorConfig")):
        module = types.ModuleType(f"vllm.v1.worker.gpu.spec_decode.{name}")
        setattr(module, cls, type(cls, (), {}))
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delitem(sys.modules, "graft_vllm.speculator", raising=False)


def test_registered_method_adapter(monkeypatch):
    stand_in_vllm(monkeypatch)
    from graft_vllm import engine, speculator

    monkeypatch.setattr(speculator, "chain_proposer", lambda config, given: proposer(limit=4))
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=4, speculator_options=None),
        scheduler_config=types.SimpleNamespace(max_num_seqs=4))
    tokens = torch.zeros((4, 32), dtype=torch.int32)
    tokens[2, :11] = torch.tensor(TEXT + [1, 2, 5])
    states = types.SimpleNamespace(all_token_ids=types.SimpleNamespace(gpu=tokens),
                                   prefill_len=types.SimpleNamespace(np=np.array([0, 0, 11, 0])))
    spec = speculator.GraftSpeculator(config, torch.device("cpu"), req_states=states)
    spec.add_request(2)
    batch = types.SimpleNamespace(num_reqs=1, req_ids=["r"], idx_mapping_np=np.array([2]))
    last = torch.tensor([0, 0, 6, 0])

    def propose(sampled: int) -> list[int]:
        out = spec.propose(batch, None, None, None, None, torch.tensor([sampled]), None, last, None, None, None)
        return out[0].tolist()

    assert propose(1) == [7, 8, 9, 10]  # prompt lookup after the first token, 6
    last[2] = 3
    assert propose(3) == [3, 3, 3, 3]  # 7, 8 accepted, then 3: no chain, padded with the last token
    assert spec.chains.counts.accepted == 2
    spec.on_requests_finished({"r"})
    assert "r" not in spec.chains
    assert engine.chain_proposer  # the real factory stays for real engines


def test_datastore_lookup_is_shared_and_judges_only_its_own_lookups(tmp_path):
    from transformers import AutoTokenizer

    from graft_vllm import bench

    if not bench.MODEL.exists():
        pytest.skip(f"the default model is not at {bench.MODEL}")
    files = bench.corpus_files()[:2]
    store = bench.build_store(files, tmp_path / "store")
    tokenizer = AutoTokenizer.from_pretrained(str(bench.MODEL))
    settings = read({"GRAFT_VLLM_RETRIEVERS": "suffix-array", "GRAFT_VLLM_DATASTORE": str(store)})
    chains = ChainProposer(settings, len(tokenizer), tokenizer, 8, max_len=2048)
    ids = tokenizer.encode(files[0].read_text())[:200]
    chain = chains.start("a", ids[:100], ids[100:101])
    assert chain and chain == ids[101 : 101 + len(chain)]  # the file goes on as the datastore holds it
    chains.start("b", ids[:50], ids[50:51])
    a, b = chains.sessions["a"], chains.sessions["b"]
    assert a.retrievers[0] is b.retrievers[0]  # one instance: opened and checked once
    assert chains.retrievers.told(b.retrievers[0], b) and not chains.retrievers.told(a.retrievers[0], a)
