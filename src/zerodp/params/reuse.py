"""Memory of released CPU full buffers, kept for the next gather of the same size.

[Note: reused gather memory]
A unit's full buffer gets its memory back for every gather and gives it up at the release
([Note: sharded storage] in segment.py). On CUDA the caching allocator keeps the freed block
for the next request. The CPU allocator does not: it returns buffers of megabytes to the
operating system, so every gather writes into fresh pages, and the first touch of each page
faults. Measured on torch 2.13 CPU for a 6 MiB copy into a fresh buffer: 0.7-1.5 ms alone, 2.3
ms inside the bench's step, against 0.12 ms into a reused one; the bench's 25M-parameter GPT on
2 ranks gathers 16 units of 12 MiB per step: 34 ms per step in that one copy (issue 18).

So on CPU the released memory is kept here, keyed by size, and handed to the next gather of a
buffer of that size by swapping data pointers: the buffer's storage object stays the same, so
the views autograd saved keep pointing at it, as with the resize. What is kept plus what is
gathered stays under the schedule's bound on gathered bytes (``ShardedParams.gathered_bound``):
a release keeps its memory only if it fits, and an allocation of another size (or of a pinned
gather's own buffer) first frees kept memory until it fits. Between steps the kept memory stays
allocated; the memory report shows it (``gathered_cached``, in its ``device`` total).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

# A private torch method (its public users are ``torch.utils.swap_tensors`` and module
# loading); where it is missing, buffers are resized as before.
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class GatherMemory:
    """Freed full-buffer memory, by size in bytes, at most ``bound()`` bytes with what is in
    use. ``bound`` is read again at every allocation it cannot serve (mixed precision re-stores
    the buffers after the engine is built; in steady state nothing misses, so the bound, a walk
    over the units, is not recomputed per release)."""

    def __init__(self, bound: Callable[[], int]) -> None:
        self._bound = bound
        self._limit = bound()
        self._free: defaultdict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self.cached_bytes = 0

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cpu" and _SWAP

    def fill(self, storage: torch.UntypedStorage, nbytes: int, in_use: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory, kept memory of that size first;
        ``in_use``: bytes gathered besides."""
        kept = self._free.get(nbytes)
        if kept:
            holder = kept.pop()
            storage._swap_data_ptr_(holder)  # type: ignore[attr-defined]
            self.cached_bytes -= nbytes
            return
        self.make_room(nbytes, in_use)
        storage.resize_(nbytes)

    def make_room(self, nbytes: int, in_use: int) -> None:
        """Free kept memory (largest sizes first) until ``nbytes`` more fit under the bound
        with ``in_use`` bytes gathered besides."""
        self._limit = self._bound()
        for size in sorted(self._free, reverse=True):
            holders = self._free[size]
            while holders and self.cached_bytes + in_use + nbytes > self._limit:
                holders.pop()  # its memory is freed with it
                self.cached_bytes -= size

    def take(self, storage: torch.UntypedStorage, in_use: int) -> None:
        """Leave ``storage`` empty: keep its memory if ``in_use`` gathered bytes plus what is
        kept leave room for it under the bound, else free it."""
        nbytes = storage.nbytes()
        if nbytes and self.cached_bytes + in_use + nbytes <= self._limit:
            holder = torch.UntypedStorage(0, device=storage.device)
            holder._swap_data_ptr_(storage)  # type: ignore[attr-defined]
            self._free[nbytes].append(holder)
            self.cached_bytes += nbytes
            return
        storage.resize_(0)
