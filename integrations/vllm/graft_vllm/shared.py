"""graft's own retrievers that an engine's requests share: its datastore lookups, one instance for all; and its
response cache, one index of every response the engine produced with a view of it per request (the response it is
generating, searched too, and committed when the request ends).

graft's own loop runs one request at a time, so its ``responses`` retriever keeps the live response in itself; an
engine that batches keeps many live at once, hence one view each over the one index.
"""

from __future__ import annotations

from plugins.response_cache import ResponseCache
from plugins.store_retriever import StoreRetriever


def shareable(retriever: object) -> bool:
    """Whether ``retriever`` is one of graft's datastore lookups: they read only the context (``start`` resets
    nothing), so one instance serves every request, and the store is opened and checked once."""
    return isinstance(retriever, StoreRetriever)


class SharedResponses:
    """The index of graft's ``responses`` retriever as built from the settings, shared by per-request views."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    @staticmethod
    def holds(retriever: object) -> bool:
        """Whether ``retriever`` is graft's response cache (a third party's ``responses`` is made per request)."""
        return isinstance(retriever, ResponseCache)

    def view(self) -> ResponseCache:
        """A response cache for one request over the shared index; its ``close`` commits the response into it.
        No file: the settings' ``responses.file`` is the shared cache's, read once when the engine started."""
        c = self.cache
        return ResponseCache(c.index, c.min_match, c.max_length, c.max_matches, None, c.factor, c.min_score)

    def close(self) -> None:
        """Save the shared index to ``responses.file`` (when one was named)."""
        self.cache.close()
