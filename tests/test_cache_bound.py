"""benchmarks/cache_bound.py: the share of an answer's tokens that only a cache of earlier answers predicts."""

from __future__ import annotations

from benchmarks import cache_bound


def test_only_what_earlier_answers_add_counts_as_the_caches():
    words: dict[str, int] = {}
    ids = lambda text: [words.setdefault(w, len(words)) for w in text.split()]  # noqa: E731
    encode = lambda messages: ids(" ".join(m["content"] for m in messages))  # noqa: E731
    questions = {1: {"turns": ["say a b c d"]}, 2: {"turns": ["go on", "again"]}}
    answers = [{"question_id": 1, "category": "x", "choices": [{"turns": ["a b c d a b c d"]}]},
               {"question_id": 2, "category": "y", "choices": [{"turns": ["e a b c", "e a b c"]}]}]
    counts = cache_bound.bound(answers, questions, encode, ids)
    # x: after "say a b c d", the answer's "a b" cannot be guessed (one word before it matches), "c d" can; the
    # repeat, all of it; no earlier answer
    assert +counts["x"] == {"tokens": 8, "own": 6}
    # y: its first "c" (after "a b") only answer x predicts; the second turn repeats the first, which its own
    # prompt holds (and, as an earlier answer, the cache too)
    assert +counts["y"] == {"tokens": 8, "own": 2, "earlier": 3, "earlier_only": 1}
    assert "| **all** | 16 |" in cache_bound.table(counts)
