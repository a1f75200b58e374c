"""The target on the fixed-shape path: each step's verification, acceptance and cache compaction at a bucket's
shape, captured once per bucket as CUDA graphs on a GPU (eager on a CPU), and read by the host once.

A step writes the bucket's static inputs (one host-to-device copy), runs the verification region (the padded
forward, graft_cli/runtime/fixed_shapes.py) and the acceptance region (graft_cli/runtime/device_accept.py: the
target's choices, the accepted path, the KV rows moved into place), then reads ``[count, bonus, rows]`` once: the
only point where the host waits for the device. A proposer that drafts ahead (``ahead``: the cost-aware builder
over a head or a draft model, ``Needs.queue``) queues the next draft between the acceptance and the read, from the
unread result (:class:`~graft_cli.core.Outcome`), and what it queued comes back in the same read. Verification is
captured per (bucket, keys read, hidden states wanted) and acceptance per (the same, and the sampling settings),
so a new temperature records a small graph, never the model again; both keys carry the addresses they recorded
(the KV block, the noise ring), and a cache that grows drops them.

A grammar's masks (each row's allowed tokens, made on the host along the row's own path) ride in the same one
copy, after the inputs, as bits; the acceptance region unpacks them and chooses among allowed tokens only, so a
constrained step neither uploads nor reads more than a free one.

A step the buckets cannot hold -- a tree past the largest bucket (run at its padded size, eagerly) or one whose
padding would pass the reserved cache -- still takes the same route where it can; only a tree with no room left
falls back to the eager verification and the host's acceptance (with the same noise, from the ring).

``--graphs compiled`` runs the same path with every keyed region compiled first (graft_cli/runtime/compiled.py).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Sequence

import numpy as np
import torch

from graft_cli.core import defaults_for, GraftError, Needs, Outcome, Shapes, Step, Tree
from graft_cli.runtime.device_accept import NoiseRing, accepted_rows, choose, compact, following, top_k_rows
from graft_cli.runtime.fixed_shapes import BUCKETS, Padded, StaticInputs, bucket, key_rows, padded_forward
from graft_cli.runtime.compiled import Compiler, Compiling
from graft_cli.runtime.graphs import Capture, CudaCapture, Graphs
from graft_cli.runtime.sampling import Noise, Sampling, chosen
from graft_cli.runtime.target import PREFILL_CHUNK, Forward, Layers, Progress, Rule, Target, input_device, verified

SWITCH = ("auto", "on", "off", "compiled")  # --graphs


class FixedShapeTarget(Target):
    """A :class:`Target` whose steps run at fixed shapes (``capture``: how a region is recorded; None runs every
    region eagerly, as on a CPU; a :class:`Compiling` one compiles each region first)."""

    def __init__(self, model: torch.nn.Module, chunk: int = PREFILL_CHUNK, progress: Progress | None = None,
                 capture: Capture | Compiling | None = None, buckets: tuple[int, ...] = BUCKETS) -> None:
        super().__init__(model, chunk, progress)
        self.cache.zeroed = True  # attention reads unfilled rows (masked): never garbage there
        self.buckets = buckets
        self.graphs = Graphs(capture)
        # made once, written in place; with room for a grammar's masks (uploaded only by a constrained step)
        self.inputs = {size: StaticInputs(size, self.device, self.vocab_size) for size in buckets}
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

    def rule(self, sampling: Sampling, noise: Noise | None, needs: Needs, prompt: int) -> Rule:
        """The request's noise kept in a ring a graph reads (the same rows, by position)."""
        ring = None if noise is None else NoiseRing(noise, self.vocab_size, max(self.buckets) + 1)
        return Rule(sampling, ring, needs, prompt)

    @torch.inference_mode()
    def first(self, prompt: Sequence[int], out: Forward, rule: Rule,
              capacity: int) -> tuple[int, np.ndarray | None, list[float] | None]:
        """The prefill's token, (needed) its row's top-k and what ``Needs.queue`` queues from the token, in one
        read, so that a request's first step, like every other, reads the device once."""
        needs = rule.needs
        if (not needs.successors and needs.queue is None) or rule.constraint is not None:  # a grammar: eager
            return super().first(prompt, out, rule, capacity)
        choice = chosen(out.logits[-1], rule.sampling, rule.noise, 0)
        top = top_k_rows(out.logits[-1:, : self.text_vocab], needs.successors) if needs.successors else choice[:0]
        queued = None if needs.queue is None else needs.queue(prefill_outcome(prompt, out, needs.layers, choice,
                                                                              capacity))
        parts = [choice.double(), top.flatten().double(), *(() if queued is None else (queued.double(),))]
        read = torch.cat(parts).to("cpu").numpy()
        k = top.numel()
        return (int(read[0]), read[1 : 1 + k].reshape(1, -1).astype(np.float32) if needs.successors else None,
                None if queued is None else read[1 + k :].tolist())

    @torch.inference_mode()
    def step(self, context: list[int], tree: Tree, rule: Rule) -> Step:
        """Verify ``tree`` after ``context`` and accept on the device; what ``Needs.queue`` queues from the unread
        result (the next draft) is read with it."""
        self.graphs.trim()  # a step's start: no graph's outputs are still to be read
        rows, past, ring, needs = len(tree) + 1, self.length, rule.noise, rule.needs
        size, capacity = bucket(rows, self.buckets), self.cache.layers[0].keys.shape[2]
        if past + size > capacity:  # no room to pad: the eager step (nothing queued: drafted after it)
            return super().step(context, tree, rule)
        keys = key_rows(past + size, capacity)
        inputs = self.inputs.get(size) or self.inputs.setdefault(size, StaticInputs(size, self.device,
                                                                                     self.vocab_size))
        depths, position = tree.depths(), rule.position(context)
        if ring is not None:
            ring.fill(position, position + int(depths.max()) + 1)
        constraint = rule.constraint  # a grammar's masks, made on the host, ride in the inputs' one copy
        inputs.write(context[-1], tree, depths, past, position, ring.size if ring is not None else 1,
                     None if constraint is None else constraint.bitmask(tree))
        captured = size in self.buckets  # a tree past the largest bucket runs at its own size, eagerly
        hidden = needs.hidden
        layers = needs.layers if hidden else ()
        with self.kernels:  # set while a graph records: what it records is what replays
            padded = self.graphs.run(("verify", size, hidden, layers, keys, self.layout) if captured else None,
                                     partial(padded_forward, self.model, self.cache, self.cached, inputs, hidden,
                                             keys, layers))
        noise = None if ring is None else ring.rows
        key = ("accept", size, keys, hidden, layers, rule.sampling, needs.successors, needs.queue is not None,
               self.layout, None if noise is None else noise.data_ptr(), constraint is not None)
        packed, features, path = self.graphs.run(key if captured else None,
                                                 partial(self._accept_region, inputs, padded, needs, rule.sampling,
                                                         noise, constraint is not None))
        queued = None
        if needs.queue is not None and path is not None and (features is not None or not hidden):
            queued = needs.queue(Outcome(path[:1], path[1:], features))
        # the step's one read: how many rows, the bonus, the rows, the top-k; then what was queued ahead
        read = (packed if queued is None else torch.cat([packed.double(), queued.double()])).to("cpu").numpy()
        count = int(read[0])
        self.length = past + count
        nodes = (read[3 : 2 + count].astype(np.int64) - 1).tolist()
        if constraint is not None:
            constraint.advance([tree.nodes[i].token for i in nodes] + [int(read[1])])
        self.cache.settle(self.length)
        top = None
        if needs.successors:
            top = read[2 + size : packed.shape[0]].reshape(size, -1)[:rows].astype(np.float32)
        return verified(context, tree, nodes, int(read[1]),
                        logits=padded.logits[:rows],
                        hidden=Layers(padded.hidden, self.device, rows) if hidden and not layers else None,
                        successors=top, features=None if features is None else features[:count],
                        queued=None if queued is None else read[packed.shape[0] :].tolist())

    def _accept_region(self, inputs: StaticInputs, padded: Padded, needs: Needs, sampling: Sampling,
                       noise: torch.Tensor | None,
                       masked: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The target's choices (``masked``: among the tokens the uploaded grammar masks allow), the accepted rows,
        the cache compacted to them, and (asked for) every row's top-k, the accepted rows' features gathered in
        path order and ``[count, the token after each]`` (what :class:`Outcome` hands a draft queued ahead): what
        an acceptance graph captures."""
        logits = inputs.mask(padded.logits) if masked else padded.logits
        rows = None if noise is None else noise.index_select(0, inputs.slots)
        packed = accepted_rows(choose(logits, sampling, rows), inputs)
        compact(self._blocks(), inputs, packed[2:])
        features = None if padded.features is None else padded.features.index_select(0, packed[2:])
        path = torch.cat([packed[:1], following(packed, inputs)]) if needs.queue is not None else None
        if not needs.successors:
            return packed, features, path
        top = top_k_rows(padded.logits[:, : self.text_vocab], needs.successors)  # the model's, as eagerly
        return torch.cat([packed.double(), top.flatten().double()]), features, path

    def _blocks(self) -> list[torch.Tensor]:
        """Every KV block of the cache (one shared block, and a layer's own where its keys did not fit it)."""
        cache = self.cache
        return [block for block in (cache.block, *(layer.own for layer in cache.layers)) if block is not None]


def use_graphs(switch: str, device: object) -> bool:
    """``--graphs``: ``auto`` is the device's default (on CUDA, off on a CPU, where padding costs real compute)."""
    if switch not in SWITCH:
        raise GraftError(f"--graphs must be one of {', '.join(SWITCH)}, not '{switch}'")
    return defaults_for(device).graphs if switch == "auto" else switch != "off"


def use_compiler(switch: str, device: object) -> bool:
    """Whether the fixed-shape path's regions are compiled: ``--graphs compiled``, or ``auto`` where the device's
    defaults say so (graft_cli/runtime/compiled.py)."""
    defaults = defaults_for(device)
    return switch == "compiled" or (switch == "auto" and defaults.graphs and defaults.compiled)


def make_target(model: torch.nn.Module, switch: str = "auto", chunk: int = PREFILL_CHUNK,
                progress: Progress | None = None, eager: type[Target] = Target,
                fixed: type[FixedShapeTarget] = FixedShapeTarget) -> Target:
    """The target ``--graphs`` asks for: the fixed-shape path (captured as CUDA graphs on a GPU, eager on a CPU;
    its regions compiled with ``compiled``) or the eager one (``eager`` and ``fixed``: the classes, for a subclass
    that records more). A model sharded over devices (``--device-map``) keeps the eager path, with a line saying
    so."""
    device = input_device(model)
    if not use_graphs(switch, device):
        return eager(model, chunk, progress)
    if len({p.device for p in model.parameters()}) > 1:
        print("graft: --graphs: a model sharded over devices verifies on the eager path", file=sys.stderr)
        return eager(model, chunk, progress)
    capture = CudaCapture() if device.type == "cuda" else None
    return fixed(model, chunk, progress, Compiling(capture, Compiler()) if use_compiler(switch, device) else capture)


def prefill_outcome(prompt: Sequence[int], out: Forward, layers: Sequence[int], choice: torch.Tensor,
                    capacity: int) -> Outcome:
    """The prefill's result before its read: each prompt row it fed (``prompt``) with the token after it, the last
    with the prefill's own choice ``[1]`` (still on the device), and those rows' states of ``layers``."""
    device = choice.device
    tokens = torch.cat([torch.tensor(list(prompt[1:]), dtype=torch.long, device=device), choice])
    features = None
    if layers and out.hidden is not None:
        features = torch.cat([out.hidden[i] for i in layers], dim=-1)
    return Outcome(torch.tensor([len(prompt)], device=device), tokens, features, capacity)


def drafter_shapes(target: Target) -> Shapes | None:
    """How a drafter's levels follow ``target``: at fixed shapes when its steps are, captured into a memory pool of
    the drafter's own (a draft queued before a step's read replays between the acceptance graph and the read, so
    its graphs must never reuse the memory of the target's outputs); None on the eager path."""
    if not isinstance(target, FixedShapeTarget):
        return None
    graphs = target.graphs
    capture = graphs.capture.apart() if isinstance(graphs.capture, CudaCapture) else graphs.capture
    return Shapes(capture if graphs.compiler is None else Compiling(capture, graphs.compiler))
