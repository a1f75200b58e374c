"""``graft serve``: the model and method of ``graft generate``, behind an OpenAI-compatible HTTP server
(graft_cli/server/, docs/serve.md). Logs go to stderr; it binds to 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.core.defaults import PREFIX_CACHE_MIB
from graft_cli.cli.options import (
    AdjacencyFile, Budget, Chain, Datastore, Depth, Device, DeviceMap, Forward, Draft, DraftAhead, DraftTopK, DraftVocab,
    DraftWeights, DraftWindow, Dtype, Graphs, MaxNewTokens, Method, Model, PrefillChunk, PrefixCache, PruneAt,
    RetrieverOpt, Retrievers, RopeTheta, Threads, TreeShape, Truncate, method_config,
)

SERVER = "Server"


def serve(
    model: Model = DEFAULT_MODEL,
    method: Method = "graft",
    draft: Draft = None,
    budget: Budget = None,
    tree: TreeShape = None,
    depth: Depth = None,
    draft_top_k: DraftTopK = None,
    prune_at: PruneAt = None,
    chain: Chain = False,
    draft_vocab: DraftVocab = None,
    draft_window: DraftWindow = None,
    draft_weights: DraftWeights = None,
    draft_ahead: DraftAhead = None,
    rope_theta: RopeTheta = None,
    adjacency_file: AdjacencyFile = None,
    retrievers: Retrievers = None,
    datastore: Datastore = None,
    retriever_opt: RetrieverOpt = [],
    max_new_tokens: MaxNewTokens = 512,
    device: Device = "auto",
    dtype: Dtype = "auto",
    device_map: DeviceMap = None,
    forward: Forward = "auto",
    truncate: Truncate = None,
    prefill_chunk: PrefillChunk = 512,
    graphs: Graphs = "auto",
    threads: Threads = None,
    prefix_cache: PrefixCache = PREFIX_CACHE_MIB,
    host: str = typer.Option("127.0.0.1", "--host", rich_help_panel=SERVER, help="Address to bind (0.0.0.0: every interface; think before you do)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, rich_help_panel=SERVER, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="GRAFT_API_KEY", rich_help_panel=SERVER, help="Require this key (Authorization: Bearer KEY); also GRAFT_API_KEY."),
    max_queue: int = typer.Option(16, "--max-queue", min=0, rich_help_panel=SERVER, help="Requests that may wait while one runs; past it a request gets 429."),
    served_name: Optional[str] = typer.Option(None, "--served-model-name", rich_help_panel=SERVER, help="The name clients give as 'model' (default: --model as given)."),
    response_cache: bool = typer.Option(True, "--response-cache/--no-response-cache", rich_help_panel=SERVER, help="Retrieve from every response this server has given (the `responses` retriever), for methods that retrieve by default."),
) -> None:
    """Serve the model over the OpenAI API: chat and text completions, streamed or whole."""
    from graft_cli.api import open_generator
    from graft_cli.method.config import with_response_cache
    from graft_cli.server.app import Service, bind, serve as run_server

    config = method_config(locals())
    if response_cache:
        config = with_response_cache(config)
    sock = bind(host, port)  # a port in use is one line before the model loads, and "serving" is said once bound
    generator = open_generator(model, config, device, dtype, device_map, prefill_chunk, graphs=graphs,
                               threads=threads, prefix_cache=prefix_cache, forward=forward)
    name = served_name or model
    service = Service(generator, name, max_queue, max_new_tokens, api_key, truncate)
    shown = "every interface" if host in ("0.0.0.0", "::") else host
    print(f"graft: serving {name} ({config.method}) at http://{host}:{port}/v1 on {shown}; Ctrl-C or SIGTERM stops",
          file=sys.stderr, flush=True)
    run_server(service, sock)
