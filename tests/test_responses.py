"""The response cache retriever: a repeated request answered from the cache (lossless, greedy and sampled), the
index against a full scan, eviction past the budget, the file kept between processes (and refused when foreign or
corrupt), `graft responses info | clear`, and the cache on by default for a --jsonl batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

import plugins.response_index as response_index
from datastores.responses import read_responses, write_responses
from datastores.suffix_array import SEP
from graft_cli.core import GraftError, RetrieverEnv, Stats, Step, Tree
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.method.config import MethodConfig, with_response_cache
from graft_cli.runtime.engine import decode
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from graft_cli.bench.synthetic import word_tokenizer
from plugins.prompt_lookup import PromptLookup
from plugins.response_index import ResponseIndex, lookup
from plugins.response_cache import make
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture
from tests.tiny import tiny_model

PROMPTS = [[5, 17, 33, 2, 9, 40], [5, 17, 33, 2, 9, 41], [60, 61, 5, 17, 33], [9, 40, 81, 3]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def cache(**options: str):
    return make(RetrieverEnv(vocab_size=97, tokenizer=word_tokenizer(), options=options, name="responses"))


def run(model, proposer, prompt, sampling=Sampling(), seed=None, n=80) -> tuple[list[int], Stats]:
    stats = Stats()
    tokens = [t for step in decode(Target(model), proposer, prompt, sampling, n, set(), seed, stats) for t in step]
    return tokens, stats


def test_a_repeated_prompt_is_answered_from_the_cache(model):
    proposer = GraftProposer(16, [cache()])
    first, before = run(model, proposer, PROMPTS[0])
    second, after = run(model, proposer, PROMPTS[0])
    assert second == first == run(model, GraftProposer(0), PROMPTS[0])[0]
    assert before.tau < 1.5 and after.tau > 8  # the whole answer came back from the cache
    assert after.accepted["responses"] > 0.8 * len(second)


def test_sampling_gives_the_same_text_with_and_without_the_cache(model):
    sampling = Sampling(temperature=0.9)
    plain = run(model, GraftProposer(0), PROMPTS[0], sampling, seed=7)[0]
    proposer = GraftProposer(16, [cache()])
    assert run(model, proposer, PROMPTS[0], sampling, seed=7)[0] == plain
    again, stats = run(model, proposer, PROMPTS[0], sampling, seed=7)
    assert again == plain and stats.tau > 4


def test_greedy_text_is_plain_decodings_with_a_warm_cache(model):
    """Overlapping prompts, the cache warm from every earlier answer, beside the other retrievers."""
    proposer = GraftProposer(16, [PromptLookup(), cache(**{"responses.min_match": "1"})])
    for prompt in PROMPTS * 2:
        assert run(model, proposer, prompt, n=60)[0] == run(model, GraftProposer(0), prompt, n=60)[0]


@pytest.mark.parametrize("recent_min", [16, response_index.RECENT_MIN])
def test_the_index_finds_what_a_full_scan_finds(monkeypatch, recent_min):
    """Longest match and every continuation, through merges, evictions and compactions."""
    monkeypatch.setattr(response_index, "RECENT_MIN", recent_min)
    rng = np.random.default_rng(1)
    for _ in range(60):
        index = ResponseIndex(max_tokens=int(rng.integers(50, 400)), width=4)
        added = [rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist() for _ in range(25)]
        for response in added:
            index.add([response])
        alive, total = [], 0
        for response in reversed(added):
            if total + len(response) > index.max_tokens:
                break
            alive, total = [response, *alive], total + len(response)
        tokens, offsets = index.sequences()
        assert [tokens[a:b].tolist() for a, b in zip(offsets, offsets[1:])] == alive
        context = rng.integers(0, 4, int(rng.integers(1, 8))).tolist()
        n, rows = lookup(index.runs(), context, 4, 1, 10**6, 3)
        want, conts = 0, []
        for m in range(min(4, len(context)), 0, -1):
            conts = [r[p + 1 : p + 4] for r in alive for p in range(m - 1, len(r) - 1) if r[p - m + 1 : p + 1] == context[-m:]]
            if conts:
                want = m
                break
        assert n == want
        got = sorted(tuple(row[: row.index(SEP)] if SEP in row else row) for row in rows.tolist())
        assert got == sorted(map(tuple, conts))


def test_factor_keeps_a_short_match_from_proposing_deep():
    """``responses.factor``: a continuation is at most factor x the matched length deep (SuffixDecoding's rule)."""
    retrievers = {factor: cache(factor=factor, min_match="1") for factor in ("0", "1", "2")}
    answer = list(range(10, 40))
    for retriever in retrievers.values():
        retriever.start([1, 2])
        retriever.observe(Step([1, 2, *answer], answer, Tree(), []))
        retriever.start([3])
    depth = {factor: max(node.depth for node in r.retrieve([3, 10, 11], 64).nodes) for factor, r in retrievers.items()}
    assert depth == {"0": 16, "1": 2, "2": 4}  # 2 tokens matched; 0: max_length
    with pytest.raises(GraftError, match="factor"):
        cache(factor="x")


def test_min_score_proposes_only_nodes_worth_a_slot_and_calibrates_on_the_whole_lookup():
    retrievers = {score: cache(min_score=score) for score in ("0", "0.3")}
    for retriever in retrievers.values():
        for answer in ([10, 11, 12, 13], [10, 11, 20, 21], [10, 11, 30, 31]):  # "10 11" went three ways
            retriever.start([1])
            retriever.observe(Step([1, *answer], answer, Tree(), []))
        retriever.start([1])
    every, kept = (retrievers[s].retrieve([1, 10, 11], 64) for s in ("0", "0.3"))
    assert len(every) == 6 and kept.nodes == []  # three branches of two, each 1/(3 + 1): under 0.3
    pending = [tree for tree, _ in retrievers["0.3"].calibration.pending.values()]
    assert [len(tree) for tree in pending] == [6]  # what it judges against the next step: the whole lookup


def test_past_the_budget_the_oldest_responses_are_evicted():
    index = ResponseIndex(max_tokens=1000, width=4)
    rng = np.random.default_rng(0)
    for i in range(200):
        index.add([[90, i % 80, *rng.integers(0, 80, 48).tolist()]])
        assert index.size <= 1000
    assert len(index) == 1000 // 50
    assert len(index.main) + len(index.recent) < 1.3 * 1000 + 2 * len(index)  # the evicted ones compacted away
    assert lookup(index.runs(), [90, 0], 4, 2, 64, 4)[0] == 0  # the 120th response, evicted
    assert lookup(index.runs(), [90, 199 % 80], 4, 2, 64, 4)[0] == 2  # the newest


def test_the_cache_file_round_trip(model, tmp_path):
    path = tmp_path / "cache" / "responses.npz"
    first = cache(**{"responses.file": str(path)})
    text = run(model, GraftProposer(16, [first]), PROMPTS[0])[0]
    assert not path.exists()  # written when the session closes
    first.close()
    saved = read_responses(path)
    assert saved.responses == 1 and saved.sequences()[0].tolist() == [*PROMPTS[0][-8:], *text]
    warm = cache(**{"responses.file": str(path)})
    again, stats = run(model, GraftProposer(16, [warm]), PROMPTS[0])
    assert again == text and stats.tau > 8  # the new session starts warm
    warm.close()
    assert read_responses(path).responses == 2
    unchanged = cache(**{"responses.file": str(path)})
    unchanged.start(PROMPTS[1])  # nothing generated: nothing to add, nothing to write
    unchanged.close()
    assert read_responses(path).responses == 2


def test_a_foreign_or_corrupt_file_is_refused_in_one_line(tmp_path):
    foreign = tmp_path / "foreign.npz"
    write_responses(foreign, np.array([1, 2, 3], dtype=np.uint32), np.array([0, 3]), "v1:another", 97)
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 not a zip at all")
    wide = tmp_path / "wide.npz"
    write_responses(wide, np.array([1, 2, 3], dtype=np.uint32), np.array([0, 3]), None, 50000)
    for path, message in ((foreign, "another tokenizer"), (corrupt, "not a readable response cache"),
                          (wide, "vocabulary of 50000")):
        with pytest.raises(GraftError, match=message) as e:
            cache(**{"responses.file": str(path)})
        assert "\n" not in str(e.value)


def test_graft_responses_info_and_clear(model, tmp_path, capsys):
    path = tmp_path / "responses.npz"
    retriever = cache(**{"responses.file": str(path)})
    run(model, GraftProposer(16, [retriever]), PROMPTS[0], n=30)
    retriever.close()
    code, out, err = run_cli(["responses", "info", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out) | {"bytes": 0} == {
        "file": str(path), "responses": 1, "tokens": 36, "longest": 36, "bytes": 0, "vocab_size": 97,
        "tokenizer": read_responses(path).fingerprint}
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    code, out, err = run_cli(["responses", "clear", str(other)], capsys)
    assert code == 2 and "not a readable response cache" in err and other.exists() and err.count("\n") == 1
    code, out, err = run_cli(["responses", "clear", str(path)], capsys)
    assert code == 0 and "cleared" in out and not path.exists()
    code, out, err = run_cli(["responses", "clear", str(path)], capsys)
    assert code == 0 and "nothing to clear" in out
    code, out, err = run_cli(["responses", "info", str(path)], capsys)
    assert code == 2 and "no response cache" in err


def test_the_cache_is_on_by_default_for_a_batch_of_methods_that_retrieve():
    graft = with_response_cache(MethodConfig("graft"))
    assert graft.retrievers == ["prompt", "recycling", "responses"]
    stored = with_response_cache(MethodConfig("graft", options={"datastore": "corpus"}))
    assert stored.retrievers == ["prompt", "recycling", "suffix-array", "responses"]
    assert with_response_cache(MethodConfig("ngram")).retrievers == ["prompt", "responses"]  # vLLM's name for pld
    for config in (MethodConfig("ar"), MethodConfig("recycling"), MethodConfig("graft", retrievers=["prompt"])):
        assert with_response_cache(config).retrievers == config.retrievers


def test_a_jsonl_batch_retrieves_its_earlier_answers(tiny_dir, tmp_path, capsys):
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "prompt": "one two three four"}) + "\n" for i in range(2)))
    argv = ["generate", "--jsonl", "-f", str(lines), "--model", str(tiny_dir), "-n", "40", "--device", "cpu"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    first, second = [json.loads(line) for line in out.splitlines()]
    assert first["text"] == second["text"]
    assert second["stats"]["accepted"].get("responses", 0) > first["stats"]["accepted"].get("responses", 0)
    code, out, err = run_cli([*argv, "--retrievers", "prompt"], capsys)  # the user's list stays as given
    assert code == 0 and all("responses" not in json.loads(line)["stats"]["proposed"] for line in out.splitlines())


def test_a_session_without_output_adds_nothing():
    retriever = cache()
    retriever.start([1, 2, 3])
    retriever.start([4, 5])  # the first request produced nothing
    retriever.observe(Step([4, 5, 6], [6], Tree(), [0, 1]))
    assert retriever.retrieve([4, 5, 6], 8).nodes == [] and len(retriever.index) == 0
    retriever.close()
    assert len(retriever.index) == 1 and retriever.index.sequences()[0].tolist() == [4, 5, 6]
