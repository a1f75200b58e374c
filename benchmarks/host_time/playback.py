"""Playback: a decoding's model forwards recorded once (their outputs and their writes to the KV caches), then
played back without running them, on a modelled clock; and the measurement that says why (host code on warm
caches and right after a CPU forward's worth of weights). See the package's docstring."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from graft_cli.core import Tree
from graft_cli.drafting import LatencyModel
from graft_cli.runtime.kv_cache import PositionCache


class Replay:
    """Model forwards recorded once (outputs and KV-cache writes), then played back without running them, on a
    modelled clock that every pass starts from zero: a target forward costs ``target_s`` times the CUDA latency
    curve at the rows it feeds, a draft forward ``draft_share`` of that, host code nothing."""

    def __init__(self, target_s: float, draft_share: float, write_kv: bool = False) -> None:
        self.target_s, self.draft_share = target_s, draft_share
        self.write_kv = write_kv  # play back cache writes as zeros in host memory, not only their rows
        self.curve = LatencyModel.default("cuda")
        self.calls: list[tuple[int, Any, list]] = []  # (rows fed, outputs, cache writes) per outermost forward
        self.replaying = False
        self.at = 0  # the next recorded call to play back
        self.now = 0.0  # the modelled clock (seconds)
        self._writes: list | None = None  # the running forward's cache writes, while recording
        self._zeros: dict = {}

    def clock(self) -> float:
        return self.now

    def begin(self, replaying: bool) -> None:
        """A pass from the start: the record's (forwards run) or a replay's, the modelled clock at zero."""
        self.replaying, self.at, self.now = replaying, 0, 0.0

    def wrap(self, fn: Callable, target: bool, cache: PositionCache) -> Callable:
        """``fn`` recorded or played back; ``cache``: the cache its writes go to (played back there: a replay's
        proposer has caches of its own)."""

        @functools.wraps(fn)
        def forward(*args, **kwargs):
            if self._writes is not None and not self.replaying:  # nested in a recorded forward: runs as part of it
                return fn(*args, **kwargs)
            rows = _rows(args, kwargs)
            self.now += self.target_s * (1.0 if target else self.draft_share) * self.curve(rows)
            if self.replaying:
                return self._play(rows, cache)
            self._writes = []
            try:
                out = fn(*args, **kwargs)
                self.calls.append((rows, _copied(out), self._writes))
            finally:
                self._writes = None
            return out

        return forward

    def watch(self, cache: PositionCache) -> None:
        """Log every write to ``cache``'s layers made by a recorded forward (the replay repeats them): each layer's
        ``update`` wrapped on the layer, which the model calls through its cache."""
        for layer in cache.layers:
            layer.update = self._logged(layer.number, layer.update)

    def _logged(self, number: int, update: Callable) -> Callable:
        @functools.wraps(update)
        def logged(keys, values, *args, **kwargs):
            if self._writes is not None:
                self._writes.append((number, tuple(keys.shape), keys.dtype, keys.device))
            return update(keys, values, *args, **kwargs)

        return logged

    def _play(self, rows: int, cache: PositionCache) -> Any:
        if self.at >= len(self.calls) or self.calls[self.at][0] != rows:
            want = self.calls[self.at][0] if self.at < len(self.calls) else "none"
            raise SystemExit(f"host_time: the replay diverged at forward {self.at} ({rows} rows fed, {want} "
                             "recorded): its timing would not be of the same decoding")
        _, out, writes = self.calls[self.at]
        self.at += 1
        for number, shape, dtype, device in writes:
            layer = cache.layers[number]
            zeros = self._zeros.get((shape, dtype, device))
            if zeros is None:
                zeros = self._zeros[(shape, dtype, device)] = torch.zeros(shape, dtype=dtype, device=device)
            if self.write_kv:
                layer.update(zeros, zeros)
            elif cache.write_index is None:  # (a fixed-shape forward writes through the index: no rows to count)
                # a GPU writes the keys and values in its own memory: only the rows are counted here. Writing
                # zeros (a verification's rows of every layer, megabytes) would evict the host code's caches
                # as a CPU forward does, a cost that does not transfer to a GPU
                layer.filled = layer.make_room(zeros)
        return out  # not a copy: every vocabulary-wide use of it is played back too, so nothing changes it


@contextmanager
def wrapped_forward(module: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``module.forward`` replaced by ``wrap`` of it on the instance, and put back on leaving: the class's again,
    or the instance's own (a hook's: accelerate's, for a dispatched model)."""
    own = module.__dict__.get("forward")
    module.forward = wrap(module.forward)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _rows(args: tuple, kwargs: dict) -> int:
    """Rows a forward feeds: its token ids' (or first tensor's) length."""
    if isinstance(kwargs.get("input_ids"), torch.Tensor):  # a transformers model: [batch, rows]
        return int(kwargs["input_ids"].shape[1])
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)  # the head's [rows, ...]
    return 1 if x is None or not x.dim() else int(x.shape[0])


def _copied(out: Any) -> Any:
    """``out`` with every tensor in it cloned (caches and other objects shared): a played-back output is never
    one a caller changed."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):  # transformers' ModelOutput is one
        return type(out)(**{k: _copied(v) for k, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(_copied(v) for v in out)
    return out


def cold_caches(clock: Callable[[], float], n: int = 200) -> str:
    """Why the forwards are played back: the same host code (a 60-node tree's tokens and ancestor mask, what
    ``Target.verify`` builds) timed with warm caches, and right after a matmul that streams 128 MB of weights
    through them (as a CPU forward does; a GPU's does not)."""
    tree = Tree()
    for i in range(60):
        tree.add(i // 4 - 1, 100 + i, "x", 0.5)
    weights, x = torch.randn(4096, 8192), torch.randn(8, 4096)
    out = []
    for label, flush in (("warm", False), ("after a 128 MB matmul", True)):
        for name, work in (("tokens()", tree.tokens), ("ancestor_mask()", tree.ancestor_mask)):
            spent = 0.0
            for _ in range(n):
                if flush:
                    x @ weights
                start = clock()
                work()
                spent += clock() - start
            out.append(f"{name} {label}: {1e6 * spent / n:.1f} us")
    return "; ".join(out)
