"""Scripts that measure graft, run from the checkout's root as ``python -m benchmarks.NAME`` (benchmarks/README.md).

A package so that a script imports its neighbours as ``benchmarks.NAME`` and the checkout's own ``graft_cli``
comes first (``-m`` puts the working directory on the path); not part of the installed distribution.
"""
