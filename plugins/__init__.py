"""graft's built-in retrievers and drafters, registered under the entry-point groups ``graft.retrievers`` and
``graft.drafters`` in pyproject.toml exactly as a third-party package registers its own (docs/plugins.md).

Retrievers: ``prompt`` (prompt_lookup.py), ``recycling`` (adjacency.py), ``suffix-array``
(suffix_array_retriever.py), ``ngram`` (ngram_retriever.py) and ``responses`` (response_cache.py, over
response_index.py), with what the datastore ones share in store_retriever.py and calibration.py. Drafters:
``model`` (draft_model.py) and ``eagle3`` (eagle3.py). A module here is named for what it is, never after the
``datastores`` module it reads, so a traceback or an import names one file. Like any plugin, they import nothing
of graft_cli but ``graft_cli.plugin``.
"""
