"""graft as a library: a model and a method loaded once, then generations with the command line's guarantees.

    import graft_cli
    g = graft_cli.load("smollm2-135m-instruct", method="graft", datastores=["corpus"])
    c = g.generate("Explain KV caches in two sentences.", max_new_tokens=128)   # or messages=[...]
    c.text, c.token_ids, c.stats
    for piece in g.stream("...", temperature=0.7, seed=1):
        print(piece.text, end="")

``graft generate`` runs through this package too, so a library call and the command give the same text for the
same settings (greedy, or sampled with the same seed), whatever the method. docs/api.md is the manual.
"""

from __future__ import annotations

from typing import Any, Sequence

from graft_cli.api.generator import Completion, Generator, Piece, Request, Stream
from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.core import GraftError
from graft_cli.core.threads import use_threads
from graft_cli.method import builder as methods
from graft_cli.method.config import MethodConfig, configure
from graft_cli.runtime.fixed_target import use_graphs
from graft_cli.runtime.loading import check_forward, load_model, parse_device_map
from graft_cli.runtime.prefix_cache import PREFIX_CACHE_MIB
from graft_cli.runtime.target import Progress

__all__ = ["Completion", "Generator", "Piece", "Request", "Stream", "load", "open_generator"]


def open_generator(model: str, config: MethodConfig, device: str = "auto", dtype: str = "auto",
                   device_map: str | dict | None = None, prefill_chunk: int = 512,
                   progress: Progress | None = None, graphs: str = "auto", *, threads: int | None = None,
                   prefix_cache: float = PREFIX_CACHE_MIB, forward: str = "auto") -> Generator:
    """A Generator for a method configuration: the configuration and its datastore checked before the model loads
    (a wrong flag should not cost seconds). ``graphs``: auto, on, off or compiled (``--graphs``: the fixed-shape path).
    ``threads``: torch's CPU threads, set for the process (None: OMP_NUM_THREADS, else the cores it may use);
    ``prefix_cache``: MiB of earlier requests' KV rows kept for the requests that begin alike (0: off);
    ``forward``: auto, own or transformers (``--forward``: whose modules run the model, docs/models.md)."""
    methods.check(config)
    methods.check_datastore(config)
    use_graphs(graphs, "cpu")  # a bad value fails here, before the model loads
    check_forward(forward)
    if forward == "transformers" and dtype == "q4":
        raise GraftError("--dtype q4 runs on graft's own forward: use --forward own or auto")
    use_threads(threads)
    loaded = load_model(model, device, dtype, parse_device_map(device_map), forward=forward)
    return Generator(loaded, config, prefill_chunk, progress, graphs, prefix_cache)


def load(model: str = DEFAULT_MODEL, *, method: str = "graft", draft: str | None = None,
         datastores: Sequence[str] = (), retrievers: Sequence[str] | None = None,
         retriever_options: dict[str, str] | None = None, budget: int | str | None = None, tree: str | None = None,
         device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None, prefill_chunk: int = 512,
         adjacency_file: str | None = None, graphs: str = "auto", threads: int | None = None,
         prefix_cache: float = PREFIX_CACHE_MIB, forward: str = "auto",
         **drafting: Any) -> Generator:
    """A model (catalog name, path, or hub id) and a method, ready to generate. ``drafting``: any
    :class:`~graft_cli.core.DraftSettings` field (``depth``, ``draft_top_k``, ``prune_at``, ``chain``, ...).
    ``graphs``: ``on`` verifies at fixed shapes, captured as CUDA graphs on a GPU; ``auto``: on CUDA only.
    ``threads``: torch's CPU threads for the process (None: OMP_NUM_THREADS, else the cores it may use).
    ``prefix_cache``: MiB of KV rows kept across calls for requests that begin alike (0: off; docs/serve.md).
    ``forward``: auto, own (graft's modules, Llama and Qwen2 on a CPU) or transformers (docs/models.md)."""
    if len(datastores) > 1:
        raise GraftError("a Generator retrieves from one datastore (give one in datastores)")
    config = configure(method, budget=budget, retrievers=None if retrievers is None else list(retrievers),
                       datastore=str(datastores[0]) if datastores else None, adjacency_file=adjacency_file,
                       retriever_options=retriever_options, draft=draft, tree=tree, **drafting)
    return open_generator(model, config, device, dtype, device_map, prefill_chunk, graphs=graphs, threads=threads,
                          prefix_cache=prefix_cache, forward=forward)
