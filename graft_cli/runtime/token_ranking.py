"""How often each token of a tokenizer occurs in real text: what a reduced draft vocabulary keeps.

A drafter's LM head is a large share of its forward (a 0.5B Qwen's is 136M of 494M weights), and on a CPU a
draft forward streams all of it. Scoring only the tokens that text really uses (FR-Spec's observation; EAGLE-3's
heads do it with their own draft vocabulary) cuts that cost, and output is unchanged: a token the drafter
cannot say is simply never drafted, and the target still verifies everything.

A ranking is counted once from a corpus (``graft models vocab NAME CORPUS...``) and kept under
``graft_home()/vocab/``, filed by a digest of the tokenizer's vocabulary, so every model that spells tokens the
same way (a draft and its target) shares it. It is JSON: ranked ids and their counts, nothing to unpickle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datastores.atomic import write_text_atomic
from graft_cli.catalog import graft_home

FORMAT = 1
# what a draft model's default vocabulary covers of the counted corpus: on the Qwen pair's coding and math prompts
# (CPU) all 49K tokens the instruction corpus used ran 5.5% faster than the whole 152K vocabulary in a probe, the
# top 32K only 3.2% (the drafts lost tau to the rarer tokens they could no longer say)
COVERAGE = 0.9999


@dataclass
class Ranking:
    """Every token id by how often the corpus used it, most frequent first (ties, the unused ones among them:
    the lower id first)."""

    ids: np.ndarray  # int64, ranked
    counts: np.ndarray  # int64, the same order
    corpus: str  # what was counted (the corpus reader's summary line)

    @classmethod
    def count(cls, tokens: np.ndarray, vocab: int, corpus: str) -> Ranking:
        counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)[:vocab]
        order = np.lexsort((np.arange(vocab), -counts))
        return cls(order, counts[order], corpus)

    @property
    def used(self) -> int:
        """How many ids the corpus used at all."""
        return int(np.count_nonzero(self.counts))

    def top(self, size: int) -> np.ndarray:
        """The ``size`` most frequent ids, ascending."""
        return np.sort(self.ids[:size])

    def coverage(self, size: int) -> float:
        """The share of the counted tokens that the ``size`` most frequent cover."""
        total = int(self.counts.sum())
        return float(self.counts[:size].sum() / total) if total else 0.0

    def size_for(self, coverage: float = COVERAGE) -> int:
        """The fewest ranked ids that cover ``coverage`` of the counted tokens."""
        total = int(self.counts.sum())
        if not total:
            return 0
        return min(len(self.ids), int(np.searchsorted(np.cumsum(self.counts), coverage * total)) + 1)

    def to_json(self, tokenizer_key: str) -> dict:
        return {"format": FORMAT, "tokenizer": tokenizer_key, "corpus": self.corpus,
                "ids": self.ids.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_json(cls, data: dict, vocab: int) -> Ranking | None:
        """None for a file of another format or with ids outside ``vocab`` (a damaged or foreign file)."""
        try:
            ids = np.asarray(data["ids"], dtype=np.int64)
            counts = np.asarray(data["counts"], dtype=np.int64)
            ok = data["format"] == FORMAT and ids.shape == counts.shape and ids.ndim == 1
            ok = ok and (not len(ids) or (ids.min() >= 0 and ids.max() < vocab))
            return cls(ids, counts, str(data.get("corpus", ""))) if ok else None
        except (KeyError, TypeError, ValueError):
            return None


def tokenizer_key(tokenizer: Any) -> str:
    """A digest of how the tokenizer spells every token: the same for a draft and a target that agree."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def ranking_path(tokenizer: Any, key: str | None = None) -> Path:
    """Where the ranking of ``tokenizer`` (whose :func:`tokenizer_key` is ``key``, when known) is filed."""
    return graft_home() / "vocab" / f"{key or tokenizer_key(tokenizer)}.json"


def save(ranking: Ranking, tokenizer: Any) -> Path:
    key = tokenizer_key(tokenizer)
    path = ranking_path(tokenizer, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(ranking.to_json(key)) + "\n")
    return path


def load(tokenizer: Any, vocab: int) -> Ranking | None:
    """The ranking counted for this tokenizer, or None when there is none (or it cannot be read)."""
    if tokenizer is None:
        return None
    path = ranking_path(tokenizer)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Ranking.from_json(data, vocab) if isinstance(data, dict) else None
