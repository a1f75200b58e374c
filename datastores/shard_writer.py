"""Both sides of writing a shard's index: the :class:`Progress` a build reports its stages to, and
:class:`IndexFiles`, what the writer of a kind's index (datastores/suffix_array.py, datastores/ngram_faiss.py)
hands back for the manifest. Apart from datastores/store.py, which opens the kinds' indexes, so that the writers
need not import it."""

from __future__ import annotations

from typing import NamedTuple


class Progress:
    """Build progress callbacks (the CLI draws them with Rich); this base class ignores them."""

    def start(self, stage: str, total: float | None = None) -> None:
        """A stage begins: ``files``, ``tokens``, ``sort``, ``index``, ``write``."""

    def advance(self, stage: str, amount: float = 1, total: float | None = None) -> None:
        """Progress within a stage (``total`` may be learned late)."""

    def finish(self, stage: str) -> None:
        """A stage ended."""

    def note(self, message: str) -> None:
        """Something the user should read (e.g. skipped files)."""


class IndexFiles(NamedTuple):
    """A shard's index as its writer wrote it: the manifest's ``index`` section and the names of the files, in
    manifest order."""

    info: dict
    files: list[str]
