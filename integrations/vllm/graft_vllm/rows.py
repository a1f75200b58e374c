"""Which request each batch row holds, for an interface that hands the proposer rows of tokens but no request ids
(vLLM 0.32-0.33's ``custom_class``).

A row is the same request as last time when it grew by exactly the tokens appended since (same length before, same
first tokens, same last token); a request whose row moved (the batch is compacted when one finishes) is found by
the same test among the requests not yet seen in this call. Two requests that match the same record hold the
same tokens so far, so their drafting states are interchangeable and either may take it. A request that no row
holds in a call has finished (or left the batch, e.g. preempted: it then comes back as a new request whose prompt
is everything it had).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

HEAD = 16  # first tokens compared


@dataclass
class Held:
    key: int
    head: tuple[int, ...]
    length: int  # tokens the request had after its last call
    last: int  # its last token then


class Rows:
    def __init__(self) -> None:
        self.held: dict[int, Held] = {}  # by key
        self.at: dict[int, int] = {}  # row -> key, as of the last call
        self.seen: set[int] = set()  # keys claimed in this call
        self.next_key = 0

    def claim(self, row: int, tokens: Sequence[int], length: int, appended: int) -> tuple[int, bool]:
        """The key of the request in ``row`` (``tokens``: the row, ``length`` of them real, the last ``appended``
        new since its last call) and whether it is new to us."""
        before = length - appended
        hint = self.held.get(self.at.get(row, -1))
        found = hint if hint is not None and self._same(hint, tokens, before) else next(
            (h for h in self.held.values() if h.key not in self.seen and self._same(h, tokens, before)), None)
        new = found is None
        if found is None:
            found = Held(self.next_key, (), 0, -1)
            self.next_key += 1
            self.held[found.key] = found
        found.head = tuple(int(t) for t in tokens[: min(HEAD, length)])
        found.length, found.last = length, int(tokens[length - 1])
        self.at[row] = found.key
        self.seen.add(found.key)
        return found.key, new

    def _same(self, held: Held, tokens: Sequence[int], before: int) -> bool:
        if held.key in self.seen or held.length != before or before <= 0:
            return False
        return int(tokens[before - 1]) == held.last and tuple(int(t) for t in tokens[: len(held.head)]) == held.head

    def gone(self) -> list[int]:
        """Keys no row held in this call (they have finished); the call's bookkeeping starts over."""
        ended = [key for key in self.held if key not in self.seen]
        for key in ended:
            del self.held[key]
        self.at = {row: key for row, key in self.at.items() if key in self.held}
        self.seen = set()
        return ended
