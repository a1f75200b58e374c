"""How much of this process's cores other processes are using: what decides whether a forward's small operations
run on every thread or on one (graft_cli/core/threads.py).

On a free machine a one-token step of the default model took about 27 ms with every operation on both cores of a
2-core Zen 4 against 32 ms with them on one: its hundreds of small operations split too, once the waiting threads
spin a moment instead of sleeping. Beside one busy process the same steps fell to a fifth of their speed: a
parallel region ends when its slowest thread does, and a thread that has lost its core to the neighbour stalls
every region. So a forward spreads its operations only while the cores are free, and runs them on one thread
(the work that pays excepted) while another process takes more than its share (docs/cpu.md).

The signal is the kernel's count of the cores' busy time (``/proc/stat``, steal included) less this process's own
CPU time (its spinning threads included), sampled at most every ``SAMPLE_EVERY`` seconds: the cores' worth of work
that other processes did in the last interval. Where it cannot be read (not Linux) the machine counts as crowded,
which keeps every small operation on one thread.
"""

from __future__ import annotations

import os
from typing import Callable

SAMPLE_EVERY = 0.5  # seconds between samples: /proc/stat counts in ticks of 10 ms, 100 a second over 2 cores
CROWDED_FROM = 0.3  # other processes' cores' worth of work, beyond the cores this process leaves free
FREE_BELOW = 0.15  # ... under which a crowded machine counts as free again (between the two: unchanged)


def busy_ticks(cpus: frozenset[int]) -> int | None:
    """The busy ticks (all but idle and iowait) of ``cpus`` since boot, from ``/proc/stat``; None without one."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


def own_seconds() -> float:
    """This process's CPU time, user and system, every thread's."""
    times = os.times()
    return times.user + times.system


class Neighbours:
    """Whether other processes crowd this process's cores, judged from samples taken as :meth:`crowded` is asked.
    ``busy`` and ``own`` read the counters (replaced in tests); ``tick``: seconds a ``busy`` tick counts."""

    def __init__(self, cpus: frozenset[int], busy: Callable[[frozenset[int]], int | None] = busy_ticks,
                 own: Callable[[], float] = own_seconds, tick: float | None = None) -> None:
        self.cpus, self.busy, self.own = cpus, busy, own
        self.tick = tick if tick is not None else 1 / os.sysconf("SC_CLK_TCK")
        self.sample: tuple[float, int, float] | None = None  # when, busy ticks, own seconds
        self.state = True  # until a first interval is measured: what a forward did before it spread

    def crowded(self, now: float, threads: int) -> bool:
        """Whether, as of ``now`` (seconds, monotonic), other processes take more of the cores than the
        ``threads`` this process runs leave free."""
        if self.sample is not None and now - self.sample[0] < SAMPLE_EVERY:
            return self.state
        busy = self.busy(self.cpus)
        if busy is None:
            return True
        own = self.own()
        if self.sample is not None:
            then, busy_then, own_then = self.sample
            others = ((busy - busy_then) * self.tick - (own - own_then)) / (now - then)
            spare = max(0, len(self.cpus) - threads)
            self.state = others > spare + (FREE_BELOW if self.state else CROWDED_FROM)
        self.sample = (now, busy, own)
        return self.state
