"""Retrievers, discovered through the ``graft.retrievers`` entry-point group (built-ins included)."""
