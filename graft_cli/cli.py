"""The ``graft`` command line (placeholder while the foundation lands)."""
