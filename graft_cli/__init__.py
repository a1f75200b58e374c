"""graft: lossless speculative decoding that drafts less and retrieves more."""

__version__ = "0.1.0"
