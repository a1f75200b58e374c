"""Token rankings (graft_cli/runtime/token_ranking.py), `graft models vocab`, and the reduced draft vocabulary they
choose: its default, and the prompt's own tokens that join it per request."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from graft_cli.runtime import token_ranking
from plugins.draft_model import DraftModelDrafter, default_vocab, draft_vocab
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.token_ranking import Ranking
from tests.datastore_fixtures import make_model_dir, write_jsonl
from tests.test_cli_index import run as run_cli
from tests.test_drafters import run
from tests.tiny import VOCAB, tiny_model


class Tok:
    """A tokenizer as far as rankings look at one."""

    all_special_ids = [VOCAB - 1]
    added_tokens_decoder: dict = {}

    def __init__(self, words: int = VOCAB) -> None:
        self.words = words

    def get_vocab(self) -> dict[str, int]:
        return {f"w{i}": i for i in range(self.words)}


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_ranking_orders_by_count_then_id_and_covers_what_it_says():
    ranking = Ranking.count(np.array([5, 3, 3, 7, 7, 7, 1, 5]), 10, "four docs")
    assert ranking.ids[:4].tolist() == [7, 3, 5, 1]  # 3 and 5 tie: the lower id first
    assert ranking.ids[4:].tolist() == [0, 2, 4, 6, 8, 9]  # every unused id, by id
    assert ranking.used == 4 and ranking.top(3).tolist() == [3, 5, 7]
    assert ranking.coverage(1) == pytest.approx(3 / 8) and ranking.coverage(4) == 1.0
    assert ranking.size_for(0.5) == 2 and ranking.size_for(1.0) == 4


def test_a_ranking_is_filed_by_its_tokenizer_and_a_bad_file_is_none(home):
    ranking = Ranking.count(np.arange(40) % 7, VOCAB, "a corpus")
    path = token_ranking.save(ranking, Tok())
    assert path.parent == home / "vocab"
    back = token_ranking.load(Tok(), VOCAB)
    assert back is not None and back.ids.tolist() == ranking.ids.tolist() and back.corpus == "a corpus"
    assert token_ranking.load(Tok(words=VOCAB - 1), VOCAB) is None  # another tokenizer: another file
    assert token_ranking.load(Tok(), 5) is None  # ids past this vocabulary: not this model's
    path.write_text("{not json")
    assert token_ranking.load(Tok(), VOCAB) is None


def test_the_default_vocabulary_is_the_rankings_on_a_cpu_only(capsys):
    ranking = Ranking.count(np.array([1, 1, 1, 2]), VOCAB, "x")
    assert default_vocab(None, ranking, "cpu") == 2
    assert "scores the 2 tokens" in capsys.readouterr().err
    assert default_vocab(None, ranking, "cuda") == 0 and default_vocab(None, None, "cpu") == 0
    assert default_vocab(7, ranking, "cuda") == 7 and default_vocab(0, ranking, "cpu") == 0


def test_a_ranked_vocabulary_keeps_the_most_frequent_and_the_special_ids():
    ranking = Ranking.count(np.array([9, 9, 20, 20, 20, 4]), VOCAB, "x")
    assert draft_vocab(Tok(), VOCAB, 2, ranking).tolist() == [9, 20, VOCAB - 1]
    assert draft_vocab(Tok(), VOCAB, 2).tolist() == [0, 1, VOCAB - 1]  # no ranking: the lowest ids


def test_the_prompts_own_tokens_join_a_reduced_vocabulary_for_its_request_only():
    reduced = torch.arange(40)
    target, draft = tiny_model(seed=1), tiny_model(seed=1)  # the draft is the target: a perfect drafter
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=2, vocab=reduced)
    prompt = [*range(5, 17), 50, 51, 50]  # two ids the reduced head lacks
    truth = run(target, GraftProposer(0), prompt, 40)
    assert run(target, GraftProposer(8, drafter=drafter), prompt, 40) == truth
    assert drafter.vocab.tolist() == [*range(40), 50, 51]
    assert drafter.column[50].item() == 40 and drafter.column[51].item() == 41
    other = [*range(5, 17), 60]
    assert run(target, GraftProposer(8, drafter=drafter), other, 40) == run(target, GraftProposer(0), other, 40)
    assert drafter.vocab.tolist() == [*range(40), 60]  # the last request's own tokens are gone
    assert drafter.column[50].item() == -1 and drafter.column[60].item() == 40
    assert all(node.token in {*range(40), 60} for node in drafter.pool.nodes)


def test_graft_models_vocab_counts_a_corpus(capsys, home, tmp_path):
    from transformers import AutoTokenizer

    model = make_model_dir(tmp_path / "model", words=30, dim=32)
    corpus = write_jsonl(tmp_path / "docs.jsonl", [[1, 2, 3, 3], [3, 4]] * 5)
    code, out, err = run_cli(capsys, "models", "vocab", str(model), str(corpus))
    assert code == 0, err
    assert "4 of 31 ids used" in err
    ranking = token_ranking.load(AutoTokenizer.from_pretrained(str(model)), 31)
    assert out.strip() == str(token_ranking.ranking_path(AutoTokenizer.from_pretrained(str(model))))
    assert ranking is not None and ranking.ids[:4].tolist() == [3, 1, 2, 4]
    assert json.loads((home / "vocab" / out.strip().rsplit("/", 1)[1]).read_text())["format"] == token_ranking.FORMAT

    code, out, err = run_cli(capsys, "models", "vocab", str(model), str(tmp_path / "missing.jsonl"))
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err

