"""Keeping the host allocator from holding on to what offload frees.

[Note: host allocator]
The offloaded step allocates and frees bucket-sized host tensors on several worker threads
(optimizer state created by a first step, gathered units and their gradients on a CPU device).
glibc's malloc adapts its mmap threshold upwards after each large free and gives every thread
its own arena, so that freed memory stays in the process: measured on a 355M GPT with its
parameters and optimizer state on NVMe, the resident set grew to 16 B per parameter, three
times what the run holds (``zerodp bench --configs zero3-infinity``, docs/benchmarks.md).
``bound_host_allocator`` fixes the threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, which
also stops the adaptation): larger blocks are mapped on allocation and returned to the system
on free. It is called by ``initialize`` when anything is offloaded, first (the frees of the model's
own tensors while it is sharded would already raise the threshold), is a no-op outside glibc,
and leaves a threshold the user chose (``MALLOC_MMAP_THRESHOLD_``) alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def bound_host_allocator() -> bool:
    """Set the threshold (see the note); whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
