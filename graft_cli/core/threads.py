"""How many CPU threads a generating process runs, and how they wait: the process's setting, like its allocator
(core/memory.py), made by the commands that generate and by ``graft_cli.load(threads=...)``.

A decoding step on a CPU is a few hundred short parallel regions (each linear layer is one), and every region
ends when its slowest thread does. torch's OpenMP threads spin while they wait, so beside another busy process
the one that got a core spins on it while its partner waits for a turn: on 2 cores, ``graft generate -n 48`` fell
from 6.1 to 0.9 tokens/s beside one busy process. Threads that sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``)
hand the core back, so a busy neighbour costs about the share of the cores it takes (docs/cpu.md,
"Threads on a busy machine"). OpenMP reads that variable once, when torch is imported, so the command line sets
it before any import of torch, and only where the user has not set it; a program using graft as a library
decides for itself.

Within a forward of graft's own the threads fan out only where they pay: its operations run on one thread
(:func:`serial`), and only the linear layers of a forward of many rows go back to all of them (:func:`fanned`),
or its independent pieces of work run side by side, one thread each (:func:`spread`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Callable, Iterator, Sequence, TypeVar

from graft_cli.core.errors import GraftError

WAIT_POLICY = "PASSIVE"
# a linear layer over fewer rows runs on one thread: below it the other threads' wake-ups cost more than their
# share of the product (a 2-core Zen 4, bf16, the default model's linears: over 8 rows 0.91x one thread's speed,
# over 16 1.22x, over 64 1.70x; docs/cpu.md)
PARALLEL_ROWS = 16
# and so does a product over fewer rows whose weight is this large: one row streams it faster on two threads (the
# same machine, bf16, packed, caches cold: 13.8M weights 1.18x one thread's speed, 27.5M 1.37x, the default model's
# 576 x 49,152 LM head 1.39x; 3.5M 1.09x, 1.8M 0.66x)
PARALLEL_BYTES = 16 << 20
# fp32 attention (torch's kernels) over at least this many scores (rows x keys) runs on every thread: one row over
# 4,000 keys took a step from 71 to 60 ms on two threads (bf16's row-invariant attention stays serial: its
# operations are many and small)
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


@contextmanager
def serial(when: bool = True) -> Iterator[None]:
    """Run the block's torch operations on one intra-op thread (where ``when``), the linear layers inside it that
    :func:`fanned` wraps excepted; then restore the count.

    Why: every parallel region wakes the sleeping threads (:func:`sleep_while_waiting`), tens of microseconds,
    and ends when the slowest is done. A forward's norms, rotations, attention and cache copies are many small
    operations: on two threads a 64-row forward's ran 3-5x slower than on one, a 512-row chunk's attention 4-7x.
    The bits do not change with the count (tests/test_threads.py). Inside a compiled region nothing is switched."""
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
    them: a linear layer as :func:`product_pays` says, fp32 attention over at least ``PARALLEL_SCORES``
    scores); elsewhere nothing changes."""
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
def _pool(width: int, process: int) -> ThreadPoolExecutor:
    """The threads :func:`spread` runs on: one pool per width, made again in a forked child (``process``), whose
    copy of its parent's pool has no threads."""
    return ThreadPoolExecutor(width, thread_name_prefix="graft-spread")
