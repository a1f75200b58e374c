"""The target distribution, in one place: temperature, top-k and top-p applied the same way by every method.

Plain decoding samples from it; speculative acceptance tests candidates against it. Sharing this code is what
makes "same distribution" a property of the code rather than of careful copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top-k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Rows of logits ``[..., V]`` to the distribution we sample from (float32, rows sum to 1)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the best token always stays)
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one row of logits: argmax when greedy, else a draw from the target distribution."""
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    return draw(probabilities(logits, sampling), generator)
