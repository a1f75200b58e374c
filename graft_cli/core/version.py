"""graft's version: one literal, read by the package, its install metadata and the manifests it writes."""

__version__ = "0.1.0"
