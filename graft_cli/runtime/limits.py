"""How far a request may reach: the model's positions and its attention window, checked before any forward.

A request reaches ``prompt + max_new_tokens + tree nodes`` positions: the last verification feeds a whole tree
past the last accepted token, its nodes at positions up to its depth and into as many cache rows as it has nodes
(the method's budget bounds both). Two limits apply:

* ``max_position_embeddings``: positions past it are outside what the model was built for (learned position
  tables have no row for them; RoPE models were never trained there).
* A sliding (or chunked) attention window: such layers cache only the last ``window - 1`` tokens and mask older
  ones out, which breaks the KV compaction of tree verification (``Target.keep`` moves rows by their absolute
  index). The rule chosen: a windowed model is accepted for a request that stays inside ``window - 1`` positions,
  where its window never cuts anything and it computes exactly full attention; otherwise it is refused with the
  numbers. Layers that are not attention at all (linear attention, state-space, convolution: Qwen3-Next, Mamba
  hybrids) keep a recurrent state that cannot be rolled back to the accepted path, and are refused at load.

Either limit is a one-line error, or with ``--truncate left|right`` the prompt is cut to fit (``left`` drops its
beginning, keeping the end next to the answer; ``right`` drops its end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from graft_cli.core import GraftError

ATTENTION = {"full_attention", "sliding_attention", "chunked_attention"}
TRUNCATE = ("left", "right")


@dataclass(frozen=True)
class Limits:
    positions: int | None  # config.max_position_embeddings
    window: int | None  # the narrowest sliding or chunked attention window of any layer
    model: str  # the model type, for messages

    @property
    def reach(self) -> int | None:
        """The most positions a request may reach."""
        bounds = [b for b in (self.positions, None if self.window is None else self.window - 1) if b is not None]
        return min(bounds) if bounds else None

    def _why(self) -> str:
        if self.window is not None and self.window - 1 == self.reach:
            return (f"the {self.window}-token sliding attention window of this {self.model} model leaves "
                    f"{self.reach} (its cache drops older tokens, which tree verification cannot compact)")
        return f"the model's {self.reach} (max_position_embeddings)"

    def fit(self, ids: Sequence[int], max_new_tokens: int, tree: int, truncate: str | None = None) -> list[int]:
        """``ids``, cut to fit when ``truncate`` says how; a GraftError with the numbers when they do not fit."""
        ids = list(ids)
        need = len(ids) + max_new_tokens + tree
        if self.reach is None or need <= self.reach:
            return ids
        keep = self.reach - max_new_tokens - tree
        if truncate is None or keep < 1:
            raise TooLong(len(ids), max_new_tokens, tree, need, self._why(), keep >= 1)
        return ids[-keep:] if truncate == "left" else ids[:keep]


class TooLong(GraftError):
    """A request past the model's positions, said with its numbers in the command line's words; :meth:`said`
    words it another way (a server's request names its own ``max_tokens``)."""

    def __init__(self, prompt: int, new: int, tree: int, need: int, why: str, truncatable: bool) -> None:
        self.prompt, self.new, self.tree, self.need, self.why = prompt, new, tree, need, why
        fix = "shorten the prompt, lower --max-new-tokens, or give --truncate left|right" if truncatable else \
            "lower --max-new-tokens"
        super().__init__(self.said("--max-new-tokens", fix))

    def said(self, limit: str, fix: str) -> str:
        """The message with the new-token limit named ``limit`` and the way out ``fix``."""
        return (f"prompt ({self.prompt} tokens) + {limit} {self.new} + tree nodes {self.tree} = {self.need} "
                f"positions, more than {self.why}: {fix}")


def parse_truncate(text: str | None) -> str | None:
    if text is not None and text not in TRUNCATE:
        raise GraftError(f"--truncate must be left or right, not '{text}'")
    return text


def limits(config: Any) -> Limits:
    """The limits of a model config; refuses models whose layers are not all attention layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model = str(getattr(text, "model_type", None) or type(text).__name__)
    types = list(getattr(text, "layer_types", None) or [])
    other = sorted(set(types) - ATTENTION)
    if other:
        raise GraftError(f"{model} models are not supported: their {', '.join(other)} layers keep a recurrent state "
                         f"that cannot be rolled back to the accepted tokens (tree verification needs attention layers "
                         f"with a KV cache)")
    windows = []
    sliding = getattr(text, "sliding_window", None)
    if sliding and ("sliding_attention" in types or not types):  # no layer_types (Mistral): every layer slides
        windows.append(int(sliding))
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and "chunked_attention" in types:
        windows.append(int(chunk))
    positions = getattr(text, "max_position_embeddings", None)
    return Limits(int(positions) if positions else None, min(windows) if windows else None, model)
