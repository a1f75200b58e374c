"""How many CPU threads a generating process runs, and how they wait: the process's setting, like its allocator
(core/memory.py), made by the commands that generate and by ``graft_cli.load(threads=...)``.

A decoding step on a CPU is a few hundred short parallel regions (each linear layer is one), and every region
ends when its slowest thread does. torch's OpenMP threads spin while they wait, so beside another busy process
the one that got a core spins on it while its partner waits for a turn: on 2 cores, ``graft generate -n 48`` fell
from 6.1 to 0.9 tokens/s beside one busy process. Threads that sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``)
hand the core back, so a busy neighbour costs about the share of the cores it takes (docs/cpu.md,
"Threads on a busy machine"). OpenMP reads that variable once, when torch is imported, so the command line sets
it before any import of torch, and only where the user has not set it; a program using graft as a library
decides for itself."""

from __future__ import annotations

import os

from graft_cli.core.errors import GraftError

WAIT_POLICY = "PASSIVE"


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, as ``taskset`` or a container's cpuset sets it), as
    llama.cpp counts them; every core of the machine where the mask cannot be read."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """``OMP_NUM_THREADS`` where the user set it (torch's own convention, and what scripts that pin a child
    process's threads set), else :func:`available_cores`."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else available_cores()


def sleep_while_waiting() -> None:
    """OpenMP threads that sleep, not spin, at the end of a parallel region (unless OMP_WAIT_POLICY is set).
    Call before torch is imported: later it changes nothing."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def use_threads(threads: int | None) -> int:
    """Run torch's CPU work on ``threads`` threads (None: :func:`default_threads`), intra-op and, where torch
    still allows it (before its first parallel work), inter-op; the count used."""
    count = default_threads() if threads is None else threads
    if count < 1:
        raise GraftError(f"threads must be at least 1, got {count}")
    import torch

    torch.set_num_threads(count)
    if torch.get_num_interop_threads() != count:
        try:
            torch.set_num_interop_threads(count)
        except RuntimeError:  # torch has run inter-op work already: its pool keeps its size
            pass
    return count
