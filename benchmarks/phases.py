"""Exclusive host time per phase of a decoding step, the torch calls each makes, and its device-to-host reads:
the instrument ``host_overhead.py`` measures with (a TorchFunctionMode sees every torch call, so a call over a
vocabulary-sized tensor can be timed apart, recorded, and played back as a GPU's asynchronous work)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

FORWARD = "forward"
CAPTURED = "captured"  # a region the fixed-shape path records as a CUDA graph: one replay on a GPU
DEVICE = "device"  # torch calls over vocabulary-sized tensors outside the forwards
METADATA = {"__get__", "size", "dim", "numel", "stride", "__len__", "is_contiguous", "data_ptr", "element_size",
            "is_floating_point"}  # calls on a vocabulary-wide tensor that do no device work: never played back
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__", "__array__")


class Phases(TorchFunctionMode):
    """Exclusive time per phase (a nested phase's time is its own, not its caller's), and per phase the torch
    calls made and the device-to-host reads among them. A torch call over a vocabulary-sized tensor (at least
    ``big`` elements: softmax, top-k, argmax over logits) is device work on a GPU: timed like a forward."""

    def __init__(self, clock: Callable[[], float], big: int = 1 << 16) -> None:
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

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed

    def enter(self, name: str) -> None:
        self.stack.append([name, self.clock(), 0.0])

    def exit(self) -> None:
        phase, start, nested = self.stack.pop()
        elapsed = self.clock() - start
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
        if phase not in (FORWARD, CAPTURED) and any(isinstance(a, torch.Tensor) and a.numel() >= self.big for a in args):
            self.enter(DEVICE)
            try:
                if self.tape is None or name in METADATA:
                    return func(*args, **kwargs)
                if self.replaying:
                    if self.at >= len(self.tape) or self.tape[self.at][0] != name:
                        raise SystemExit(f"host_overhead: the replay diverged at vocabulary-wide call {self.at} "
                                         f"({name})")
                    self.at += 1
                    return self.tape[self.at - 1][1]
                out = func(*args, **kwargs)
                self.tape.append((name, out))
                return out
            finally:
                self.exit()
        return func(*args, **kwargs)

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
