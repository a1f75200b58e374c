"""The fused attention kernels graft's own forwards run on a GPU: any of torch's but cuDNN's.

Recent torch (its ``sdp_utils.cpp``) puts cuDNN's attention first for fp16 and bf16 on a Hopper or datacenter
Blackwell GPU (sm90, sm100: H100, H200, B200) with cuDNN 9.15 or newer. cuDNN builds an execution plan for each
problem it has not seen (the key length is part of the key) and caches it; a miss costs milliseconds of host
time. Speculative decoding asks a new problem nearly every forward: the cache grows by each step's accepted
tokens, a tree's size changes from step to step, and a drafter's levels differ in rows. On an H200 in bf16, a
6-layer model verified trees of about 7 nodes in 19.1 ms a step, against 4.8 ms in fp32, where cuDNN is not a
candidate, and a plain one-token step in 4.9 ms (docs/gpu.md, "The CUDA check on a GPU"). That cuDNN's plans
are the cause is inferred from this contrast and torch's source, not yet measured with this switch in place.
FlashAttention and the memory-efficient kernel need no plan.

On a CPU, transformers copies a grouped-query model's keys and values once per query head (``repeat_kv``) whenever
a mask is given, because a masked grouped attention has no kernel there; every tree verification has a mask.
SDPA's own grouped attention (``enable_gqa``) reads them once: :class:`GroupedQueryAttention` asks transformers for
it (its ``TRANSFORMERS_SDPA_FORCE_GQA`` switch), again for the forward's duration only.

So graft's forwards run with cuDNN's attention switched off, for their own duration only: transformers'
``generate`` (``graft bench``'s hf peers) keeps torch's choice, as its users get it. The switch is two flag
writes (about 1 us on this CPU; ``sdpa_kernel`` costs 17 us), so a draft level can afford it. Setting
``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` puts cuDNN last for a whole process instead.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

PLANNED = frozenset({"cuda"})  # device types whose SDPA may build a plan per problem shape


class NoCudnnAttention(AbstractContextManager):
    """Within: SDPA does not choose cuDNN's attention; on exit the flag is as it was (nesting is fine)."""

    def __init__(self) -> None:
        self._was: list[bool] = []

    def __enter__(self) -> NoCudnnAttention:
        self._was.append(torch.backends.cuda.cudnn_sdp_enabled())
        torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.enable_cudnn_sdp(self._was.pop())


class GroupedQueryAttention(AbstractContextManager):
    """Within: transformers' SDPA attention runs grouped queries through SDPA's ``enable_gqa``, mask or not; on
    exit the process environment is as it was (nesting is fine)."""

    SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"

    def __init__(self) -> None:
        self._was: list[str | None] = []

    def __enter__(self) -> GroupedQueryAttention:
        self._was.append(os.environ.get(self.SWITCH))
        os.environ[self.SWITCH] = "1"
        return self

    def __exit__(self, *exc: object) -> None:
        was = self._was.pop()
        if was is None:
            os.environ.pop(self.SWITCH, None)
        else:
            os.environ[self.SWITCH] = was


def attention_kernels(device: torch.device) -> AbstractContextManager:
    """What a forward on ``device`` runs under: :class:`NoCudnnAttention` on a GPU, :class:`GroupedQueryAttention`
    on a CPU. Reusable: make it once per model."""
    if device.type in PLANNED:
        return NoCudnnAttention()
    return GroupedQueryAttention() if device.type == "cpu" else nullcontext()
