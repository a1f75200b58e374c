"""On-disk token datastores: corpus reading, tokenisation, suffix-array and FAISS n-gram stores.

This package never imports torch or transformers: it reads the model's ``tokenizer.json`` with the
``tokenizers`` library and its embedding rows straight from safetensors, so building and querying a store is
cheap and works on machines without the model's runtime.
"""

from datastores.build import BuildSpec, build_shard, build_store
from datastores.errors import DatastoreError
from datastores.fingerprint import fingerprint_from_file, fingerprint_from_tokenizer, fingerprint_from_vocab
from datastores.store import StoreMeta, list_stores, open_store, parse_shard, read_store, remove_store, resolve_store

__all__ = [
    "BuildSpec",
    "DatastoreError",
    "StoreMeta",
    "build_shard",
    "build_store",
    "fingerprint_from_file",
    "fingerprint_from_tokenizer",
    "fingerprint_from_vocab",
    "list_stores",
    "open_store",
    "parse_shard",
    "read_store",
    "remove_store",
    "resolve_store",
]
