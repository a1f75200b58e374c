"""The allocator setting a generating process wants: freed memory kept for the next step."""

from __future__ import annotations

import ctypes
import platform

HEAP_BLOCK = 32 << 20  # allocations up to this size come from the heap (glibc's largest allowed)
HEAP_SLACK = 256 << 20  # free memory the heap may keep for reuse before it gives memory back to the system


def reuse_freed_memory() -> None:
    """Keep freed memory for the next step, as CUDA's caching allocator does. glibc maps every large block afresh
    and unmaps or trims it on free, so each step's logits (a 61-row block of a 49K vocabulary: 12 MB) fault their
    pages in and give them back: 0.5-0.7 ms of kernel time a step on the host. Only on glibc; the setting is the
    process's, like its thread count, so the commands that generate (``graft generate``, ``graft bench``) make it
    when they start, and a program using graft as a library decides for itself."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, HEAP_BLOCK)  # M_MMAP_THRESHOLD: fixed, so it no longer adapts
    libc.mallopt(-1, HEAP_SLACK)  # M_TRIM_THRESHOLD
