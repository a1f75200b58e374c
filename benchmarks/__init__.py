"""Scripts that measure graft, run from the checkout's root as ``python -m benchmarks.NAME`` (benchmarks/README.md).

A package so that a script imports its neighbours as ``benchmarks.NAME`` and the checkout's own ``graft_cli``
comes first (``-m`` puts the working directory on the path); not part of the installed distribution.
"""

from graft_cli.core.threads import wait_briefly

# every script measures graft as its commands run it, OpenMP's threads spinning briefly as they wait (core/threads.py):
# set here, before a script imports torch (a script that compares policies sets its children's own)
wait_briefly()
