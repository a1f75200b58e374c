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
from typing import Any, Callable, Sequence

import numpy as np
import torch

from graft_cli.runtime.attention import use_split_attention
from graft_cli.runtime.attention_kernels import attention_kernels
from graft_cli.models.decoder import CausalLM
from graft_cli.runtime.kv_cache import PositionCache, cache_keyword
from graft_cli.runtime.prompt_precision import prompt_layers, prompt_precision
from graft_cli.runtime.sampling import Noise, Sampling, pick
from graft_cli.runtime.verify import accept
from graft_cli.core import ROOM, Needs, Step, Tree
from graft_cli.core.constraint import Constraint

PREFILL_CHUNK = 512  # prompt tokens per prefill forward (see docs/benchmarks.md, "Long context")
Progress = Callable[[int, int], None]  # (prompt tokens prefilled so far, prompt length): at 0, then per chunk


@dataclass
class Forward:
    """A forward's outputs, on the input device: what the prefill and a verification return."""

    logits: torch.Tensor  # [T, V] for the T fed positions
    hidden: Sequence[torch.Tensor] | None  # per-layer hidden states [T, H] when asked for


@dataclass(frozen=True)
class Rule:
    """One request's choices and reads: its sampling settings and noise (a fixed-shape target's: a ring of the same
    rows), the prompt's length (a row's generated-token index is its position past it), what the proposer
    needs of each step, and the tokens the text may hold (a grammar: every row masked along its own path)."""

    sampling: Sampling
    noise: Noise | None
    needs: Needs
    prompt: int
    constraint: Constraint | None = None

    def position(self, context: Sequence[int]) -> int:
        """The generated-token index the root row of a step after ``context`` chooses (its noise row)."""
        return len(context) - self.prompt


def verified(context: list[int], tree: Tree, nodes: Sequence[int], bonus: int, **outputs: Any) -> Step:
    """The Step of a verification that accepted ``nodes`` and ``bonus``: ``context`` grows in place, so a part
    that keeps it (a draft model's next-turn reuse) sees the whole request."""
    new = [tree.nodes[i].token for i in nodes] + [bonus]
    context.extend(new)
    return Step(context, new, tree, [0, *(i + 1 for i in nodes)], **outputs)


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


def cache_for(model: torch.nn.Module, layers: int, shared: bool = True) -> PositionCache:
    """A cache for ``model``'s ``layers``: plain for graft's own forward, which calls its layers itself; under
    transformers' cache base classes for a transformers model, which checks for them (imported only then)."""
    if isinstance(model, CausalLM):
        return PositionCache(layers, shared)
    from graft_cli.runtime.hf_cache import TransformersCache  # lazy: transformers' cache module

    return TransformersCache(layers, shared)


class Target:
    def __init__(self, model: torch.nn.Module, chunk: int = PREFILL_CHUNK, progress: Progress | None = None) -> None:
        self.model = model
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        # one KV block for all layers, unless the model is sharded (each layer's cache then stays on its device)
        self.cache = cache_for(model, config.num_hidden_layers, shared=len({p.device for p in model.parameters()}) == 1)
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
        self.prompt_layers = prompt_layers(model)  # what a prompt's forward switches to bf16 (--dtype mixed)

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
        with self._attention(self.prefill_attention), self.kernels, prompt_precision(self.prompt_layers):
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

    def rule(self, sampling: Sampling, noise: Noise | None, needs: Needs, prompt: int) -> Rule:
        """A request's rule: how its steps choose and what they read."""
        return Rule(sampling, noise, needs, prompt)

    @torch.inference_mode()
    def start(self, prompt: Sequence[int], rule: Rule, capacity: int, kept: int = 0) -> Step:
        """A request of up to ``capacity`` positions: the prompt's forward and its token, the prefill's Step.
        ``kept``: leading prompt rows the cache holds already (a prefix cache wrote them): the forward feeds the
        rest, and the Step's rows (its hidden states) are theirs."""
        out = self.prefill(list(prompt), rule.needs.hidden, capacity, kept)
        first, top, queued = self.first(prompt[kept:], out, rule, capacity)
        return Step([*prompt, first], [first], Tree(), list(range(len(prompt) - kept)), out.logits, out.hidden, top,
                    queued=queued)

    def first(self, prompt: Sequence[int], out: Forward, rule: Rule,
              capacity: int) -> tuple[int, np.ndarray | None, list[float] | None]:
        """The prefill's token from its last row (``prompt``: the rows it fed); here one read, no top-k (a retriever
        that learns from it computes its own on the device, read with its next lookup) and nothing queued (the
        fixed-shape path's)."""
        if rule.constraint is None:
            return pick(out.logits[-1], rule.sampling, rule.noise, 0), None, None
        token = pick(rule.constraint.masked(Tree(), out.logits[-1:])[0], rule.sampling, rule.noise, 0)
        rule.constraint.advance([token])
        return token, None, None

    def step(self, context: list[int], tree: Tree, rule: Rule) -> Step:
        """Verify ``tree`` after ``context`` in one forward, accept on the host (``verify.accept``) and keep the
        accepted rows: the step's record."""
        out = self.verify(context[-1], tree, rule.needs.hidden)
        logits = out.logits if rule.constraint is None else rule.constraint.masked(tree, out.logits)
        result = accept(tree, logits, rule.sampling, rule.noise, rule.position(context))
        self.keep(result.rows(), len(tree) + 1)
        if rule.constraint is not None:
            rule.constraint.advance([tree.nodes[i].token for i in result.nodes] + [result.bonus])
        return verified(context, tree, result.nodes, result.bonus, logits=out.logits, hidden=out.hidden)

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
