"""graft's built-in retrievers and drafters, registered under the entry-point groups ``graft.retrievers`` and
``graft.drafters`` in pyproject.toml exactly as a third-party package registers its own (docs/plugins.md).

Retrievers: ``prompt`` (prompt_lookup.py), ``recycling`` (adjacency.py), ``suffix-array`` (suffix_array.py) and
``ngram`` (ngram_faiss.py), with what the datastore ones share in store.py and calibration.py. Drafters: ``model``
(draft_model.py) and ``eagle3`` (eagle3.py). Like any plugin, they import only the public names of
``graft_cli.core``, ``graft_cli.drafting``, ``graft_cli.runtime``, ``graft_cli.heads`` and ``graft_cli.catalog``.
"""
