"""The target on the fixed-shape path: each step's verification, acceptance and cache compaction at a bucket's
shape, captured once per bucket as CUDA graphs on a GPU (eager on a CPU), and read by the host once.

A step writes the bucket's static inputs (one host-to-device copy), runs the verification region (the padded
forward, graft_cli/runtime/fixed_shapes.py) and the acceptance region (graft_cli/runtime/device_accept.py: the
target's choices, the accepted path, the KV rows moved into place), then reads ``[count, bonus, rows]`` once: the
only point where the host waits for the device. A proposer that drafts ahead (``ahead``: the cost-aware builder
over a head or a draft model) queues the next draft between the acceptance and the read, from the unread result
(:class:`~graft_cli.runtime.target.Outcome`), and what it queued comes back in the same read. Verification is
captured per (bucket, keys read, hidden states wanted) and acceptance per (the same, and the sampling settings),
so a new temperature records a small graph, never the model again; both keys carry the addresses they recorded
(the KV block, the noise ring), and a cache that grows drops them.

A step the buckets cannot hold -- a tree past the largest bucket (run at its padded size, eagerly) or one whose
padding would pass the reserved cache -- still takes the same route where it can; only a tree with no room left
falls back to the eager verification and the host's acceptance (with the same noise, from the ring).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import torch

from graft_cli.core import defaults_for, GraftError, Tree
from graft_cli.runtime.device_accept import NoiseRing, accepted_rows, choose, compact, following, top_k_rows
from graft_cli.runtime.fixed_shapes import BUCKETS, Padded, StaticInputs, bucket, key_rows, padded_forward
from graft_cli.runtime.graphs import Capture, CudaCapture, Graphs
from graft_cli.runtime.sampling import Noise, Sampling, chosen
from graft_cli.runtime.target import (PREFILL_CHUNK, Ahead, DeviceStep, Forward, Layers, Outcome, Progress, Target,
                                      input_device)
from graft_cli.runtime.verify import Accepted, accept

SWITCH = ("auto", "on", "off")  # --graphs


@dataclass(frozen=True)
class Rule:
    """One request's choices and reads: its sampling settings, its noise ring, the top-k every row also reads
    (0: none), the hidden layers whose states the accepted rows hand a drafter (none: every layer, ungathered)."""

    sampling: Sampling
    ring: NoiseRing | None
    successors: int
    layers: tuple[int, ...] = ()  # the hidden layers a drafter reads: gathered for the accepted rows
    ahead: bool = False  # whether a proposer queues the next draft before the read (the path's tokens handed over)


class FixedShapeTarget(Target):
    """A :class:`Target` whose steps run at fixed shapes (``capture``: how a region is recorded; None runs every
    region eagerly, as on a CPU)."""

    def __init__(self, model: torch.nn.Module, chunk: int = PREFILL_CHUNK, progress: Progress | None = None,
                 capture: Capture | None = None, buckets: tuple[int, ...] = BUCKETS) -> None:
        super().__init__(model, chunk, progress)
        self.cache.zeroed = True  # attention reads unfilled rows (masked): never garbage there
        self.buckets = buckets
        self.graphs = Graphs(capture)
        self.inputs = {size: StaticInputs(size, self.device) for size in buckets}  # made once, written in place
        self.layout: tuple[int, ...] = ()  # where the KV blocks are: part of every graph's key
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.text_vocab = config.vocab_size  # the columns a retriever's vocabulary has (an LM head may be wider)

    def prefill(self, ids: list[int], hidden: bool = False, capacity: int | None = None, kept: int = 0) -> Forward:
        out = super().prefill(ids, hidden, capacity, kept)
        layout = tuple(block.data_ptr() for block in self._blocks())
        if layout != self.layout:  # the cache grew: every graph recorded the old blocks
            self.graphs.forget()
            self.layout = layout
        return out

    @torch.inference_mode()
    def first(self, logits: torch.Tensor, sampling: Sampling, noise: Noise | None, successors: int = 0,
              ahead: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
              ) -> tuple[int, np.ndarray | None, list[float] | None]:
        """The prefill's token, (asked for) its row's top-k and what ``ahead`` queues from the token, in one read,
        so that a request's first step, like every other, reads the device once."""
        if not successors and ahead is None:
            return super().first(logits, sampling, noise)
        choice = chosen(logits, sampling, noise, 0)
        top = top_k_rows(logits[None, : self.text_vocab], successors) if successors else choice[:0]
        queued = ahead(choice) if ahead is not None else None
        parts = [choice.double(), top.flatten().double(), *(() if queued is None else (queued.double(),))]
        read = torch.cat(parts).to("cpu").numpy()
        k = top.numel()
        return (int(read[0]), read[1 : 1 + k].reshape(1, -1).astype(np.float32) if successors else None,
                None if queued is None else read[1 + k :].tolist())

    def device_step(self, sampling: Sampling, noise: Noise | None, successors: int = 0,
                    layers: tuple[int, ...] = (), ahead: bool = False) -> DeviceStep:
        ring = None if noise is None else NoiseRing(noise, self.vocab_size, max(self.buckets) + 1)
        return partial(self.step, rule=Rule(sampling, ring, successors, tuple(layers), ahead))

    @torch.inference_mode()
    def step(self, root: int, tree: Tree, hidden: bool, position: int, ahead: Ahead | None = None, *,
             rule: Rule) -> tuple[Forward, Accepted]:
        """Verify ``root`` + ``tree`` and accept on the device; ``position``: the generated-token index the
        root's row chooses (its noise row when sampling); ``ahead``: what to queue from the unread result (the
        next draft), read with it."""
        rows, past, ring = len(tree) + 1, self.length, rule.ring
        size, capacity = bucket(rows, self.buckets), self.cache.layers[0].keys.shape[2]
        if past + size > capacity:  # no room to pad: the eager step
            return self._eager(root, tree, hidden, position, rule)  # nothing queued ahead: drafted after it
        keys = key_rows(past + size, capacity)
        inputs = self.inputs.get(size) or self.inputs.setdefault(size, StaticInputs(size, self.device))
        depths = tree.depths()
        if ring is not None:
            ring.fill(position, position + int(depths.max()) + 1)
        inputs.write(root, tree, depths, past, position, ring.size if ring is not None else 1)
        captured = size in self.buckets  # a tree past the largest bucket runs at its own size, eagerly
        layers = rule.layers if hidden else ()
        with self.kernels:  # set while a graph records: what it records is what replays
            padded = self.graphs.run(("verify", size, hidden, layers, keys, self.layout) if captured else None,
                                     partial(padded_forward, self.model, self.cache, self.cached, inputs, hidden,
                                             keys, layers))
        noise = None if ring is None else ring.rows
        key = ("accept", size, keys, hidden, layers, rule.sampling, rule.successors, rule.ahead, self.layout,
               None if noise is None else noise.data_ptr())
        packed, features, path = self.graphs.run(key if captured else None,
                                                 partial(self._accept_region, inputs, padded, rule, noise))
        queued = None
        if ahead is not None and path is not None and (features is not None or not hidden):
            queued = ahead(Outcome(path[:1], path[1:], features))
        # the step's one read: how many rows, the bonus, the rows, the top-k; then what was queued ahead
        read = (packed if queued is None else torch.cat([packed.double(), queued.double()])).to("cpu").numpy()
        count, bonus = int(read[0]), int(read[1])
        self.length = past + count
        self.cache.settle(self.length)
        states = Layers(padded.hidden, self.device, rows) if hidden and not layers else None
        top = None
        if rule.successors:
            top = read[2 + size : packed.shape[0]].reshape(size, -1)[:rows].astype(np.float32)
        landed = None if queued is None else read[packed.shape[0] :].tolist()
        return (Forward(padded.logits[:rows], states, top, None if features is None else features[:count], landed),
                Accepted((read[3 : 2 + count].astype(np.int64) - 1).tolist(), bonus))

    def _accept_region(self, inputs: StaticInputs, padded: Padded, rule: Rule,
                       noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The target's choices, the accepted rows, the cache compacted to them, and (asked for) every row's
        top-k, the accepted rows' features gathered in path order and ``[count, the token after each]`` (what
        :class:`Outcome` hands a draft queued ahead): what an acceptance graph captures."""
        logits = padded.logits
        rows = None if noise is None else noise.index_select(0, inputs.slots)
        packed = accepted_rows(choose(logits, rule.sampling, rows), inputs)
        compact(self._blocks(), inputs, packed[2:])
        features = None if padded.features is None else padded.features.index_select(0, packed[2:])
        path = torch.cat([packed[:1], following(packed, inputs)]) if rule.ahead else None
        if not rule.successors:
            return packed, features, path
        top = top_k_rows(logits[:, : self.text_vocab], rule.successors)
        return torch.cat([packed.double(), top.flatten().double()]), features, path

    def _eager(self, root: int, tree: Tree, hidden: bool, position: int, rule: Rule) -> tuple[Forward, Accepted]:
        """A step the buckets cannot hold: the eager verification and the host's acceptance (the same noise)."""
        out = self.verify(root, tree, hidden)
        result = accept(tree, out.logits, rule.sampling, rule.ring, position)  # type: ignore[arg-type]  # ring: at()
        self.keep(result.rows(), len(tree) + 1)
        return out, result

    def _blocks(self) -> list[torch.Tensor]:
        """Every KV block of the cache (one shared block, and a layer's own where its keys did not fit it)."""
        cache = self.cache
        return [block for block in (cache.block, *(layer.own for layer in cache.layers)) if block is not None]


def use_graphs(switch: str, device: object) -> bool:
    """``--graphs``: ``auto`` is the device's default (on CUDA, off on a CPU, where padding costs real compute)."""
    if switch not in SWITCH:
        raise GraftError(f"--graphs must be one of {', '.join(SWITCH)}, not '{switch}'")
    return defaults_for(device).graphs if switch == "auto" else switch == "on"


def make_target(model: torch.nn.Module, switch: str = "auto", chunk: int = PREFILL_CHUNK,
                progress: Progress | None = None, eager: type[Target] = Target,
                fixed: type[FixedShapeTarget] = FixedShapeTarget) -> Target:
    """The target ``--graphs`` asks for: the fixed-shape path (captured as CUDA graphs on a GPU, eager on a CPU)
    or the eager one (``eager`` and ``fixed``: the classes, for a subclass that records more). A model sharded
    over devices (``--device-map``) keeps the eager path, with a line saying so."""
    device = input_device(model)
    if not use_graphs(switch, device):
        return eager(model, chunk, progress)
    if len({p.device for p in model.parameters()}) > 1:
        print("graft: --graphs: a model sharded over devices verifies on the eager path", file=sys.stderr)
        return eager(model, chunk, progress)
    return fixed(model, chunk, progress, CudaCapture() if device.type == "cuda" else None)
