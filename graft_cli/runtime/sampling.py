"""The target distribution, in one place: temperature, top-k and top-p applied the same way by every method, and
the noise that turns it into tokens.

Sampling is Gumbel-max over noise fixed per generated position: the token at position ``t`` is
``argmax(log p_t + G_t)``, where ``p_t`` is the target distribution there and ``G_t`` a vector of Gumbel noise that
depends only on the seed and ``t``. Since ``argmax(log p + G)`` is distributed as ``p``, plain decoding samples
the target distribution; and since a speculative step computes the same argmax at every verified node, whatever
the tree holds, every method produces the very same text for the same seed (the coupling of Daliri, Musco and
Suresh, 2024). Which tree was proposed then changes only how many tokens one forward accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


class Noise:
    """Gumbel noise of one generation: row ``t`` (``t`` = 0 for the first new token) is the ``t``-th draw of one
    generator seeded with the seed, on the model's device.

    Rows are drawn one position at a time, in position order, and each exactly once (kept until every node that
    could use it has been verified), so row ``t`` is the same whatever trees were verified before: a function of
    (seed, t) alone. One ``torch.rand`` per position costs no host synchronisation on CUDA (Philox keeps its
    seed and offset on the host). Reseeding a generator per position would not do on a CPU, where the Mersenne
    Twister keeps only 32 bits of a seed.
    """

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.rows: list[torch.Tensor] = []  # rows[i] is position first + i
        self.first = 0

    def draw(self, end: int, vocab: int) -> None:
        """Draw every row before position ``end`` not drawn yet, in position order (the only place rows are
        drawn: the fixed-shape path's ring of rows takes them from here too, so both see the same values)."""
        while self.first + len(self.rows) < end:
            u = torch.rand(vocab, generator=self.generator, device=self.device)
            self.rows.append(-torch.log(-torch.log(u)))

    def at(self, offsets: torch.Tensor, start: int, span: int, vocab: int) -> torch.Tensor:
        """Noise ``[len(offsets), vocab]`` for positions ``start + offsets`` (``offsets`` on the device, each below
        ``span``, which the caller knows on the host); rows before ``start`` are never asked for again: dropped."""
        if start < self.first:
            raise ValueError(f"noise for position {start} was dropped (positions only move forward)")
        self.draw(start + span, vocab)
        del self.rows[: start - self.first]
        self.first = start
        block = torch.stack(self.rows[:span])
        return block.index_select(0, offsets)


def sample(logits: torch.Tensor, sampling: Sampling, noise: Noise, start: int, depths: np.ndarray) -> torch.Tensor:
    """The target's sampled token for each row of ``logits [T, V]``, row i at position ``start + depths[i]``:
    ``argmax(log p + G)``, where ``log p = -inf`` for the tokens temperature, top-k and top-p leave no mass."""
    offsets = torch.from_numpy(depths)  # host, uploaded at once (CUDA: pinned and asynchronous, no wait on the forward)
    cuda = logits.device.type == "cuda"
    offsets = (offsets.pin_memory() if cuda else offsets).to(logits.device, non_blocking=cuda)
    scores = torch.log(probabilities(logits, sampling))
    return (scores + noise.at(offsets, start, int(depths.max()) + 1, logits.shape[-1])).argmax(dim=-1)


def chosen(logits: torch.Tensor, sampling: Sampling, noise: Noise | None, position: int) -> torch.Tensor:
    """The token at ``position`` from its one row of logits, ``[1]`` on the device (nothing read): the argmax
    when greedy, else sampled."""
    if sampling.greedy:
        return torch.argmax(logits)[None]
    if noise is None:
        raise ValueError("sampling needs noise: a seed")
    return sample(logits.unsqueeze(0), sampling, noise, position, np.zeros(1, dtype=np.int64))


def pick(logits: torch.Tensor, sampling: Sampling, noise: Noise | None, position: int) -> int:
    """:func:`chosen`, read."""
    return int(chosen(logits, sampling, noise, position).item())
