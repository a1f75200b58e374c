"""The target model and its KV cache: prefill, one-pass tree forward, and compaction to the accepted path.

The cache always holds every accepted token except the newest one, the *root*: each step feeds the root plus the
candidate tree, so the root's own logits (the distribution for depth 1) come out of the same forward pass. The
cache is a :class:`~graft_cli.runtime.kv_cache.PositionCache`, reserved per request, so a step moves only the rows it feeds
and keeps; the prompt is prefilled in chunks (bounded peak memory, and progress for long prompts).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Callable, Sequence

import numpy as np
import torch

from graft_cli.runtime.attention import use_split_attention
from graft_cli.runtime.attention_kernels import attention_kernels
from graft_cli.runtime.kv_cache import PositionCache, cache_keyword
from graft_cli.runtime.sampling import Noise, Sampling, pick
from graft_cli.runtime.verify import Accepted
from graft_cli.core import ROOM, Tree

PREFILL_CHUNK = 512  # prompt tokens per prefill forward (see docs/benchmarks.md, "Long context")
Progress = Callable[[int, int], None]  # (prompt tokens prefilled so far, prompt length): at 0, then per chunk


@dataclass
class Forward:
    logits: torch.Tensor  # [T, V] for the T fed positions
    hidden: Sequence[torch.Tensor] | None  # per-layer hidden states [T, H] when asked for
    successors: np.ndarray | None = None  # [T, 2k] top-k ids and probabilities, read with the step (Step's)
    features: torch.Tensor | None = None  # the kept rows' named layers, gathered on the device (Step's)
    ahead: list[float] | None = None  # what a proposer queued before the read, read with it (Step's)


@dataclass
class Outcome:
    """A step's result while it is still on the device: what a drafter needs to draft the next step before the
    host reads this one, so that both come back in the step's one read (the fixed-shape path).

    ``count`` ``[1]``: the rows the accepted path keeps, the root's included; ``tokens`` ``[R]``: the token that
    followed each of those rows (the accepted tokens, then the bonus), padded past ``count``; ``features``
    ``[R, F]``: those rows' states of the drafter's layers, in the same order."""

    count: torch.Tensor
    tokens: torch.Tensor
    features: torch.Tensor | None
    start: int = 0  # a request's prefill (every prompt row, unpadded): the capacity the request reserves

    @classmethod
    def of_prefill(cls, prompt: Sequence[int], out: Forward, layers: Sequence[int], choice: torch.Tensor,
                   capacity: int) -> Outcome:
        """The prefill's result before its read: each prompt row with the token after it, the last with the
        prefill's own choice ``[1]`` (still on the device)."""
        device = choice.device
        tokens = torch.cat([torch.tensor(list(prompt[1:]), dtype=torch.long, device=device), choice])
        features = None
        if layers and out.hidden is not None:
            features = torch.cat([out.hidden[i] for i in layers], dim=-1)
        return cls(torch.tensor([len(prompt)], device=device), tokens, features, capacity)


# queued before a step's read; returns device values to read with it (None: nothing)
Ahead = Callable[[Outcome], "torch.Tensor | None"]
# (root, tree, hidden wanted, the root row's generated-token index, ahead) -> the outputs and what it accepted
DeviceStep = Callable[[int, Tree, bool, int, "Ahead | None"], tuple[Forward, Accepted]]


def on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``, without a call when it is there already (the hot path makes many)."""
    return x if x.device == device else x.to(device)


class Layers(Sequence[torch.Tensor]):
    """A verification's per-layer hidden states ``[T, H]``, each taken from transformers' ``[1, T, H]`` (and
    brought to the input device) when it is read: an EAGLE-3 head reads three layers of thirty, every step.
    ``rows``: only the first rows are the verification's (a fixed-shape forward pads the rest)."""

    def __init__(self, states: Sequence[torch.Tensor], device: torch.device, rows: int | None = None) -> None:
        self.states, self.device, self.rows = states, device, rows

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i):  # an int gives a layer, a slice a list of them
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        state = self.states[i][0]
        return on(state if self.rows is None else state[: self.rows], self.device)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs go: its input embedding's device. A model sharded by accelerate (``--device-map``)
    may have it offloaded (weights on ``meta``): then the device its hook runs it on."""
    embed = model.get_input_embeddings()
    device = embed.weight.device
    if device.type == "meta":
        device = torch.device(getattr(getattr(embed, "_hf_hook", None), "execution_device", None) or "cpu")
    return device


class Target:
    def __init__(self, model: torch.nn.Module, chunk: int = PREFILL_CHUNK, progress: Progress | None = None) -> None:
        self.model = model
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        # one KV block for all layers, unless the model is sharded (each layer's cache then stays on its device)
        self.cache = PositionCache(config.num_hidden_layers, shared=len({p.device for p in model.parameters()}) == 1)
        self.cached = {cache_keyword(model): self.cache}  # the forward keyword argument that passes the cache
        self.length = 0  # tokens held in the cache
        self.chunk = max(1, chunk)
        self.progress = progress
        self.vocab_size = model.get_input_embeddings().num_embeddings  # ids the embedding can look up
        # FlashAttention cannot take a tree mask, but the prefill's plain causal mask suits it
        cuda = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        self.prefill_attention = "flash_attention_2" if cuda and find_spec("flash_attn") else None
        self.kernels = attention_kernels(self.device)  # what every forward runs under (no per-shape plans)
        if self.device.type == "cpu":  # every row of a step or a chunk sees the whole cache: split the attention
            use_split_attention(model)

    @torch.inference_mode()
    def prefill(self, ids: list[int], hidden: bool = False, capacity: int | None = None, kept: int = 0) -> Forward:
        """Start a request of up to ``capacity`` positions (prompt + new tokens + tree room: then the cache never
        reallocates) and run the prompt through in chunks of ``self.chunk`` tokens; only the last position's
        logits are kept (FlashAttention is fine here: a chunk's mask is plain causal past the cache). ``kept``:
        leading rows the cache already holds for ``ids`` (fewer than all of them), which are not fed again."""
        self.cache.reserve(max(capacity or 0, len(ids) + ROOM), kept)
        self.length = kept
        x = torch.tensor([ids], device=self.device)
        states: list[tuple[torch.Tensor, ...]] = []
        if self.progress is not None:
            self.progress(0, len(ids))
        with self._attention(self.prefill_attention), self.kernels:
            for start in range(kept, len(ids), self.chunk):
                out = self.model(input_ids=x[:, start : start + self.chunk], **self.cached, use_cache=True,
                                 output_hidden_states=hidden, logits_to_keep=1, visible=start)
                if hidden:
                    states.append(tuple(h[0].to(self.device) for h in out.hidden_states))
                if self.progress is not None:
                    self.progress(min(start + self.chunk, len(ids)), len(ids))
        self.length = len(ids)
        joined = tuple(torch.cat(layer) if len(layer) > 1 else layer[0] for layer in zip(*states)) if hidden else None
        return Forward(out.logits[0].to(self.device), joined)

    @torch.inference_mode()
    def verify(self, root: int, tree: Tree, hidden: bool = False) -> Forward:
        """Feed the root and every tree node in one forward pass; each node sees the past and its ancestors.

        Token ids, positions and the tree's ancestor table go to the device in ONE copy; the additive mask is
        made there."""
        past, n = self.length, len(tree) + 1
        host = np.empty((n + 2 if len(tree) else 2, n), dtype=np.int64)  # tokens, positions, ancestors
        host[0, 0] = root
        host[0, 1:] = tree.tokens()
        host[1] = tree.depths() + past
        if len(tree):
            host[2:] = tree.ancestor_mask()
        block = torch.from_numpy(host).to(self.device)
        mask = None
        if len(tree):  # a lone root is plain causal decoding: no mask, exactly as `generate` runs it
            mask = torch.zeros((1, 1, n, past + n), dtype=self.dtype, device=self.device)
            mask[0, 0, :, past:].masked_fill_(block[2:] == 0, torch.finfo(self.dtype).min)
        with self.kernels:
            out = self.model(
                input_ids=block[0:1],
                position_ids=block[1:2],
                attention_mask=mask,
                **self.cached,
                use_cache=True,
                output_hidden_states=hidden,
                visible=past,  # every row sees the whole cache (graft_cli/runtime/attention.py)
            )
        self.length = past + n
        return self._forward(out, hidden)

    def first(self, logits: torch.Tensor, sampling: Sampling, noise: Noise | None, successors: int = 0,
              ahead: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
              ) -> tuple[int, np.ndarray | None, list[float] | None]:
        """The prefill's token from its last row of logits ``[V]``; here one read, no top-k (a retriever that
        learns from it computes its own on the device, read with its next lookup) and nothing queued ahead
        (the fixed-shape path's: ``ahead`` takes the token on the device and returns what to read with it)."""
        return pick(logits, sampling, noise, 0), None, None

    def device_step(self, sampling: Sampling, noise: Noise | None, successors: int = 0,
                    layers: tuple[int, ...] = (), ahead: bool = False) -> DeviceStep | None:
        """A verification that accepts on the device and compacts its own cache, for one request (the
        fixed-shape path, graft_cli/runtime/fixed_target.py; ``successors``: the top-k of every row it also
        reads, for Token Recycling; ``layers``: the hidden layers a drafter reads, gathered for the accepted
        rows on the device; ``ahead``: a proposer queues the next draft before each read); None here: the loop
        verifies, accepts on the host (``verify.accept``) and calls :meth:`keep`."""
        return None

    @torch.inference_mode()
    def keep(self, rows: list[int], fed: int) -> None:
        """Of the last ``fed`` cached positions keep only ``rows`` (0 = root, i = tree node i-1), in place.

        Keys are stored already rotated, so moving accepted entries down leaves them valid; only those move.
        """
        past = self.length - fed
        self.cache.keep(past, rows)
        self.length = past + len(rows)

    @contextmanager
    def _attention(self, implementation: str | None):
        """Run a block under another attention implementation, then return to the one that takes tree masks."""
        if implementation is None:
            yield
            return
        usual = self.model.config._attn_implementation
        self.model.set_attn_implementation(implementation)
        try:
            yield
        finally:
            self.model.set_attn_implementation(usual)

    def _forward(self, out, hidden: bool) -> Forward:
        """Logits and hidden states on the input device (a sharded model's last layers may sit elsewhere;
        ``.to`` is free when they do not)."""
        states = Layers(out.hidden_states, self.device) if hidden else None
        return Forward(on(out.logits[0], self.device), states)
