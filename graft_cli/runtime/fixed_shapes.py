"""Verification at fixed shapes: what lets one captured CUDA graph serve every step of a bucket.

A graph replays the kernels it recorded, on the memory it recorded: the same shapes, the same addresses, no host
decision inside. Eager verification changes all three every step (the tree's size, the cache's length, a mask made
anew), so here:

- the tree (with its root) is padded to a **bucket** of rows (:data:`BUCKETS`; plain decoding is the 1-row one);
  a padded row feeds token 0 at the root's position and sees only itself (a row that sees nothing gives NaN);
- the keys are the request's **reserved cache** (graft_cli/runtime/kv_cache.py): a forward writes its rows at
  ``past + i`` through a device index and attention reads the block's first :func:`key_rows` rows -- 1024, then
  powers of two, then all of it -- the rows past the tree masked (they are zero-filled or hold old finite rows:
  a NaN there would still poison the output);
- the **inputs** -- tokens, positions, each row's parent, its noise slot and its ancestor row -- are one static
  device block per bucket, written in place by ONE host-to-device copy a step (pinned and asynchronous on CUDA);
- the additive **mask** ``[1, 1, B, capacity]`` is made on the device from the ancestor rows and the root's
  position, so no host value but the input block changes between replays.

Padding costs real compute on a CPU (where the path runs eagerly, for the tests); on a GPU a verification is
bound by streaming the weights, and 16 rows cost about what 1 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graft_cli.core import Tree

BUCKETS = (1, 16, 32, 64, 128)  # rows a verification is padded to (root + tree)
PAST_LARGEST = 64  # a bigger tree is padded to a multiple of this, and runs eagerly
KEYS_FROM = 1024  # the fewest keys a verification reads; then powers of two, up to the reserved cache
HEADER = 4  # input rows before the ancestor rows: tokens, positions, parents, noise slots


def bucket(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The rows a verification of ``rows`` rows is padded to."""
    for size in buckets:
        if rows <= size:
            return size
    return -(-rows // PAST_LARGEST) * PAST_LARGEST


def key_rows(end: int, capacity: int) -> int:
    """The keys a verification reaching row ``end`` reads: a power of two from :data:`KEYS_FROM` on (a few
    graphs per bucket over a long generation), never past the reserved cache. Reading the whole cache instead
    would make a short prompt's first steps read all the rows a long answer reserved."""
    rows = KEYS_FROM
    while rows < end:
        rows *= 2
    return min(rows, capacity)


class StaticInputs:
    """One bucket's inputs in one device block (int64), kept for the target's life so that a captured graph reads
    them where it recorded them; the host fills a mirror and copies it over whole.

    Its grid ``[4 + B, B]``: row 0 the tokens, 1 the positions, 2 each row's parent row (the root and padded rows:
    themselves), 3 each row's slot in the noise ring (graft_cli/runtime/device_accept.py), then B ancestor rows
    (1: row i sees row j, itself included; a real row always sees the root, a padded one only itself). After it,
    with ``vocab``, a grammar's masks ``[B, ceil(vocab / 64)]``: each row's allowed tokens as bits (token t: bit
    ``t % 64`` of word ``t // 64``), copied with the grid in the same one copy when a step is constrained."""

    def __init__(self, size: int, device: torch.device, vocab: int = 0) -> None:
        self.size = size
        cuda = device.type == "cuda"
        grid, words = (HEADER + size) * size, -(-vocab // 64)
        self.host = torch.zeros(grid + size * words, dtype=torch.long, pin_memory=cuda)  # host: the mirror
        self.array = self.host[:grid].numpy().reshape(HEADER + size, size)
        self.masks = self.host[grid:].numpy().reshape(size, words).view(np.int32)  # [B, 2 * words] as the engine's
        self.masks[:] = -1  # a padded row: anything (it is never accepted)
        self.block = torch.zeros(grid + size * words, dtype=torch.long, device=device)
        self.grid, self.allowed_bits = grid, self.block[grid:].view(size, words)
        square = self.block[:grid].view(HEADER + size, size)
        self.tokens, self.positions = square[0:1], square[1:2]  # [1, B]: as the model takes them
        self.parents, self.slots, self.ancestors = square[2], square[3], square[HEADER:]
        self.non_blocking = cuda
        self._used = size  # rows of the ancestor block the last write filled (the rest hold padding already)
        self._masked = 0  # rows of the masks a constrained write filled (the rest allow anything)
        self.eye = np.eye(size, dtype=np.int64)
        self.array[HEADER:] = self.eye

    def write(self, root: int, tree: Tree, depths: np.ndarray, past: int, position: int, ring: int,
              masks: np.ndarray | None = None) -> None:
        """Fill the mirror for ``root`` + ``tree`` (``depths``: its rows', ``tree.depths()``) over ``past`` cached
        rows (``position``: the generated-token index the root's row chooses; ``ring``: the noise ring's rows) and
        copy it to the device: with ``masks`` (a grammar's, ``Constraint.bitmask``), they ride in the same copy."""
        n, size, a = len(tree) + 1, self.size, self.array
        a[0, 0], a[0, 1:n], a[0, n:] = root, tree.tokens(), 0
        a[1, :n], a[1, n:] = depths + past, past
        a[2, 0], a[2, 1:n], a[2, n:] = 0, tree.parents(), np.arange(n, size)
        a[3, :n], a[3, n:] = (depths + position) % ring, 0
        ancestors = a[HEADER:]
        used = max(n, self._used)
        ancestors[:used, :used] = self.eye[:used, :used]  # padding again where the last tree was
        if n > 1:
            ancestors[:n, :n] = tree.ancestor_mask()
        if masks is not None:
            self.masks[n:self._masked] = -1
            self._masked = n
            width = min(masks.shape[1], self.masks.shape[1])
            self.masks[:n, :width], self.masks[:n, width:] = masks[:, :width], 0  # past the engine's ids: never
        self._used = n
        end = None if masks is not None else self.grid  # unconstrained: the grid alone
        self.block[:end].copy_(self.host[:end], non_blocking=self.non_blocking)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` with every token the uploaded masks forbid at -inf (on the device: what an
        acceptance graph of a constrained step captures; the same rows as ``Constraint.masked``)."""
        bits = self.allowed_bits.view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[-1]] != 0
        return logits.masked_fill(~allowed, float("-inf"))


def visible_keys(past: torch.Tensor, rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which of ``capacity`` keys each query row sees, ``[B, capacity]`` bool, made on the device: every key
    before ``past`` (a one-element tensor: the cached context), then the block of keys from ``past`` on as
    ``rows [B, R]`` says (non-zero: seen), nothing after it."""
    width, device = rows.shape[1], rows.device
    relative = torch.arange(capacity, device=device) - past  # a key's row in the block (< 0: the context)
    inside = (relative >= 0) & (relative < width)
    seen = rows.index_select(1, relative.clamp(0, width - 1)) != 0
    return (relative < 0)[None, :] | (seen & inside[None, :])


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask ``[B, K]`` as transformers' additive one ``[1, 1, B, K]`` (0 seen, ``finfo.min`` not)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def tree_mask(inputs: StaticInputs, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """The verification's additive mask ``[1, 1, B, capacity]``, made on the device: every row sees the cached
    context (keys before the root's position), then its ancestor rows of the tree block; the rest is
    ``finfo.min``."""
    return additive(visible_keys(inputs.positions[0, :1], inputs.ancestors, capacity), dtype)


@dataclass
class Padded:
    """A fixed-shape forward's outputs: static tensors when captured (the next replay overwrites them)."""

    logits: torch.Tensor  # [B, V]
    hidden: tuple[torch.Tensor, ...] | None  # per layer [1, B, H], when asked for (and no layers named)
    features: torch.Tensor | None = None  # [B, len(layers) * H]: the named layers' states side by side


def padded_forward(model: torch.nn.Module, cache, cached: dict, inputs: StaticInputs, hidden: bool,
                   keys: int, layers: tuple[int, ...] = ()) -> Padded:
    """The target's forward over one bucket's inputs: rows written at ``past + i`` through the cache's device
    index, the first ``keys`` keys of the block read under :func:`tree_mask`. What a verification graph
    captures. With ``layers`` (a drafter's, ``hidden`` set) only those layers' states leave it, side by side:
    the graph keeps one small output instead of every layer's."""
    past = inputs.positions[0, :1]
    cache.write_index, cache.read_rows = past + torch.arange(inputs.size, device=past.device), keys
    try:
        out = model(input_ids=inputs.tokens, position_ids=inputs.positions,
                    attention_mask=tree_mask(inputs, keys, cache.layers[0].keys.dtype), **cached, use_cache=True,
                    output_hidden_states=hidden)
    finally:
        cache.write_index, cache.read_rows = None, None
    if hidden and layers:
        return Padded(out.logits[0], None, torch.cat([out.hidden_states[i][0] for i in layers], dim=-1))
    return Padded(out.logits[0], tuple(out.hidden_states) if hidden else None)
