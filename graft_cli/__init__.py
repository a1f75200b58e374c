"""graft: lossless speculative decoding that drafts less and retrieves more."""

from graft_cli.core.version import __version__

__all__ = ["__version__"]
