"""The host process set up for JAX: its memory allocator (for XLA's CPU runtime) and its garbage
collector (for tracing).

XLA's CPU client allocates a compiled step's buffers on every call. glibc serves each large
allocation with a fresh mmap (and per-thread arenas with their own heaps), so every call
page-faults its buffers in again, and a training step pays that in system time on every call
(docs/design/training-speed.md). One heap that keeps freed memory makes the next call reuse the
same pages.

Tracing and lowering a JAX program make millions of short-lived Python objects, nearly all freed
by reference counting as they go. Python's collector still walks the young ones after every 700
new containers, and the older generations with them every 10 and 100 of those passes: at start-up
(every program traced, lowered, read from the compile cache) that was a tenth of a command's CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

__all__ = ["collect_less_often", "reuse_freed_memory"]

# a young-generation pass every 50,000 new containers (Python: 700), a full one every 50 x 100 of them
GC_THRESHOLDS = (50_000, 50, 100)

# glibc's mallopt parameters (malloc.h); a trim threshold of -1 turns trimming off (mallopt(3))
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


@functools.cache
def reuse_freed_memory() -> bool:
    """glibc only (elsewhere a no-op, False): every allocation from the main heap (one arena, no
    mmap per large block) and freed memory kept for reuse, never trimmed. The resident size then
    stays at its peak, which a training run reaches at its first step anyway. Call it before
    JAX starts its threads (first thing in a CLI): a thread that holds its own arena keeps it."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc
        mallopt = None
    return mallopt is not None and all(
        mallopt(param, value) == 1 for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    )


def collect_less_often() -> None:
    """The garbage collector's passes spaced for a process that traces JAX programs
    (`GC_THRESHOLDS`): reference cycles are still collected, a few megabytes of them later."""
    gc.set_threshold(*GC_THRESHOLDS)
