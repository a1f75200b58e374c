"""How many CPU threads a generating process runs, how they wait, and which work goes to all of them: the
process's setting, like its allocator (core/memory.py), made by the commands that generate and by
``graft_cli.load(threads=...)``.

A decoding step on a CPU is a few hundred short parallel regions, and every region ends when its slowest thread
does. libgomp's threads spin about 3 ms before they sleep, so beside another busy process the one that got a
core spins on it while its partner waits for a turn: on 2 cores, ``graft generate -n 48`` fell from 6.1 to 0.9
tokens/s beside one busy process. Threads that sleep at once pay a wake-up of tens of microseconds per region
instead. So the command line makes them spin briefly (``GOMP_SPINCOUNT``, a thirtieth of libgomp's default),
enough to carry a forward's back-to-back regions, and before any import of torch (OpenMP reads it once), only
where the user has not chosen (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``); a program using graft as a library
decides for itself.

Within graft's own forward the threads then take every operation while the machine is free, and only the work
that pays for them while other processes crowd its cores (:func:`crowded`, core/neighbours.py): then the
operations run on one thread (:func:`serial`) and only the linear layers of many rows or large weights go back to
all of them (:func:`fanned`), or independent pieces of work run side by side, one thread each (:func:`spread`).
A row's bits are the same either way (docs/cpu.md, "Threads within a forward")."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Callable, Iterator, Sequence, TypeVar

from graft_cli.core.errors import GraftError
from graft_cli.core.neighbours import Neighbours

WAIT_SPINS = "10000"  # GOMP_SPINCOUNT: how long a waiting OpenMP thread spins before it sleeps (libgomp: 300,000)
# a linear layer over fewer rows runs on one thread: below it the other threads' wake-ups cost more than their
# share of the product (a 2-core Zen 4, bf16, the default model's linears: over 8 rows 0.91x one thread's speed,
# over 16 1.22x, over 64 1.70x; docs/cpu.md)
PARALLEL_ROWS = 16
# and so does a product over fewer rows whose weight is this large: one row streams it faster on two threads (the
# same machine, bf16, packed, caches cold: 13.8M weights 1.18x one thread's speed, 27.5M 1.37x, the default model's
# 576 x 49,152 LM head 1.39x; 3.5M 1.09x, 1.8M 0.66x)
PARALLEL_BYTES = 16 << 20
# fp32 attention (torch's kernels) over at least this many scores (rows x keys) runs on every thread, and over
# fewer on one, free or crowded (its bits depend on the count): one row over 4,000 keys took a step from 71 to 60
# ms on two threads (bf16's row-invariant attention, whose bits do not, follows the forward)
PARALLEL_SCORES = 2048
SERIAL_ROWS = 512  # a forward of fewer rows runs serially but for its linears; a whole prompt chunk does not
_WIDE: ContextVar[int] = ContextVar("graft_wide_threads", default=1)  # the count an enclosing serial() left
T = TypeVar("T")


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


def wait_briefly() -> None:
    """OpenMP threads that spin briefly, then sleep, at the end of a parallel region (unless the user set
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``). Call before torch is imported: later it changes nothing."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", WAIT_SPINS)


def crowded(now: float) -> bool:
    """Whether a forward keeps its small operations on one thread, as of ``now`` (``time.monotonic()``): while
    other processes crowd this process's cores, and always where the threads sleep as soon as they wait
    (``OMP_WAIT_POLICY=PASSIVE``: a wake-up per region costs more than the second thread gives)."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        return True
    import torch

    return _neighbours(os.getpid()).crowded(now, torch.get_num_threads())


def use_threads(threads: int | None) -> int:
    """Run torch's CPU work on ``threads`` threads (None: :func:`default_threads`), intra-op and, where torch
    still allows it (before its first parallel work), inter-op; the count used. The watch on the cores takes its
    first sample here, so that by the first forward after a model's load it has an interval to judge."""
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
    crowded(time.monotonic())
    return count


@contextmanager
def serial(when: bool = True) -> Iterator[None]:
    """Run the block's torch operations on one intra-op thread (where ``when``), the linear layers inside it that
    :func:`fanned` wraps excepted; then restore the count.

    Why: every parallel region ends when its slowest thread is done, and a forward's norms, rotations, attention
    and cache copies are many small operations: where a thread has lost its core to another process (or sleeps
    at once between regions) they ran several times slower on two threads than on one (:func:`crowded`); a long
    chunk's attention pieces run side by side instead (:func:`spread`). The bits do not change with the count
    (tests/test_threads.py). Inside a compiled region nothing is switched."""
    import torch

    count = torch.get_num_threads()
    if not when or count == 1 or torch.compiler.is_compiling():
        yield
        return
    token = _WIDE.set(count)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(count)
        _WIDE.reset(token)


@contextmanager
def fanned(when: bool = True) -> Iterator[None]:
    """Inside :func:`serial`: run the block on the threads ``serial`` left, where ``when`` (the work pays for
    them: a linear layer as :func:`product_pays` says); elsewhere nothing changes."""
    wide = _WIDE.get()
    if wide == 1 or not when:
        yield
        return
    import torch

    torch.set_num_threads(wide)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@contextmanager
def wide_only_if(pays: bool) -> Iterator[None]:
    """Run the block on every thread the forward has where ``pays``, on one where not, whether the forward runs
    its operations on one thread (:func:`serial`) or on all: for work whose bits depend on the thread count
    (torch's fp32 attention splits a row's keys between threads), so that none depends on how crowded the
    machine is."""
    if _WIDE.get() > 1:  # inside serial(): widen where it pays
        with fanned(pays):
            yield
    else:  # a forward on every thread: narrow where it does not
        with serial(not pays):
            yield


def product_pays(rows: int, weight_bytes: int, large: int = PARALLEL_BYTES) -> bool:
    """Whether a linear layer's product over ``rows`` rows of a weight of ``weight_bytes`` bytes pays for every
    thread (:func:`fanned`): many rows, or a weight of at least ``large`` bytes, whose product alone outlasts the
    threads' wake-ups (a kernel that unpacks its weight as it multiplies says from how many)."""
    return rows >= PARALLEL_ROWS or weight_bytes >= large


def spread(work: Sequence[Callable[[], T]]) -> list[T]:
    """Inside :func:`serial`: run independent pieces of work side by side on as many Python threads as ``serial``
    left intra-op threads, each piece's torch operations on one thread (torch releases the interpreter's lock
    while it computes); their results in order. Elsewhere, or for one piece, one after another.

    Why: a long prompt chunk's row-invariant attention is pieces of rows whose many small operations gain nothing
    from intra-op threads, while the pieces themselves are independent (at 3,500 cached keys a 512-row chunk's
    took 40 ms a layer on two such threads against 79 ms on one). A piece's bits do not depend on its thread."""
    wide = _WIDE.get()
    if wide == 1 or len(work) < 2:
        return [piece() for piece in work]
    return list(_pool(wide, os.getpid()).map(lambda piece: piece(), work))


@cache
def _neighbours(process: int) -> Neighbours:
    """This process's watch on its cores (made again in a forked child, whose counters are its own)."""
    return Neighbours(frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset())


@cache
def _pool(width: int, process: int) -> ThreadPoolExecutor:
    """The threads :func:`spread` runs on: one pool per width, made again in a forked child (``process``), whose
    copy of its parent's pool has no threads."""
    return ThreadPoolExecutor(width, thread_name_prefix="graft-spread")
