"""Exclusive host time per phase of a decoding step, the torch calls each makes and its device-to-host reads; and
the recorder that hands graft its modelled clock while the product's own phases time the host on this one.

A TorchFunctionMode sees every torch call, so a call over a vocabulary-sized tensor can be timed apart, recorded,
and played back as a GPU's asynchronous work (see the package's docstring)."""

from __future__ import annotations

import functools
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from graft_cli.core import Clock, Recorder

FORWARD = "forward"
CAPTURED = "captured"  # a region the fixed-shape path records as a CUDA graph: one replay on a GPU
DEVICE = "device"  # torch calls over vocabulary-sized tensors outside the forwards
METADATA = {"__get__", "size", "dim", "numel", "stride", "__len__", "is_contiguous", "data_ptr", "element_size",
            "is_floating_point"}  # calls on a vocabulary-wide tensor that do no device work: never played back
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__", "__array__")


class Phases(TorchFunctionMode):
    """Exclusive time per phase (a nested phase's time is its own, not its caller's), and per phase the torch
    calls made and the device-to-host reads among them, all counted only while ``counting`` (a request's steps,
    not its prefill). A torch call over a vocabulary-sized tensor (at least ``big`` elements: softmax, top-k,
    argmax over logits) is device work on a GPU: timed like a forward."""

    def __init__(self, clock: Clock, big: int = 1 << 16) -> None:
        super().__init__()
        self.clock, self.big = clock, big
        self.stack: list[list] = []  # [name, start, time spent in nested phases]
        self.time: Counter = Counter()
        self.reads: Counter = Counter()
        self.calls: Counter = Counter()
        self.counting = False
        self.tape: list | None = None  # vocabulary-wide calls' outputs, recorded (None: they run)
        self.replaying = False  # ... and played back instead of run
        self.at = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed as phase ``name``."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed

    def enter(self, name: str) -> None:
        self.stack.append([name, self.clock(), 0.0])

    def exit(self) -> None:
        phase, start, nested = self.stack.pop()
        elapsed = self.clock() - start
        if self.counting:
            self.time[phase] += elapsed - nested
        if self.stack:
            self.stack[-1][2] += elapsed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counting:
            return func(*args, **kwargs)
        phase = self.stack[-1][0] if self.stack else "outside"
        name = getattr(func, "__name__", "")
        self.calls[phase] += 1
        if name in READS:
            self.reads[phase] += 1
        wide = any(isinstance(a, torch.Tensor) and a.numel() >= self.big for a in args)
        if wide and phase not in (FORWARD, CAPTURED):
            with self.phase(DEVICE):
                return self._device(func, name, args, kwargs)
        return func(*args, **kwargs)

    def _device(self, func, name: str, args: tuple, kwargs: dict):
        """A vocabulary-wide call: run (and, while recording, its output kept) or played back from the tape."""
        if self.tape is None or name in METADATA:
            return func(*args, **kwargs)
        if self.replaying:
            if self.at >= len(self.tape) or self.tape[self.at][0] != name:
                raise SystemExit(f"host_time: the replay diverged at vocabulary-wide call {self.at} ({name})")
            self.at += 1
            return self.tape[self.at - 1][1]
        out = func(*args, **kwargs)
        self.tape.append((name, out))
        return out

    def reset(self) -> None:
        for counter in (self.time, self.reads, self.calls):
            counter.clear()

    def cost(self, n: int = 4000) -> float:
        """Seconds this mode adds to one torch call: small calls timed without it and with it (best of 5)."""
        x = torch.ones(4)

        def calls() -> float:
            start = self.clock()
            for _ in range(n):
                x.add(1)
                x[1]
            return self.clock() - start

        plain = min(calls() for _ in range(5))
        self.counting = True
        self.stack.append(["calibration", self.clock(), 0.0])
        with self:
            counted = min(calls() for _ in range(5))
        self.stack.clear()
        self.counting = False
        self.reset()
        return max(counted - plain, 0.0) / (2 * n)


class HostRecorder(Recorder):
    """The recorder handed to ``build``: every decision and ``Stats.times`` read the modelled ``clock`` (the same
    in every pass, so a replay decides as its record did), and each phase the product times with
    :meth:`Recorder.timed` (the loop's prefill, start, propose, verify and update, GraftProposer's retrieval) is
    entered on ``phases`` too, so the host's seconds fall into the product's own phases."""

    def __init__(self, clock: Clock, phases: Phases) -> None:
        super().__init__(clock)
        self.phases = phases

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        with self.phases.phase(phase), super().timed(phase):
            yield
