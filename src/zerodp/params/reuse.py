"""Memory of released CPU full buffers, kept for the next gather of the same size.

[Note: reused gather memory]
A unit's full buffer gets its memory back for every gather and gives it up at the release
([Note: sharded storage] in segment.py). On CUDA the caching allocator keeps the freed block
for the next request. The CPU allocator does not: it returns buffers of megabytes to the
operating system, so every gather writes into fresh pages, and the first touch of each page
faults. Measured on torch 2.13 CPU for a 6 MiB copy into a fresh buffer: 0.7-1.5 ms against
0.12 ms into a reused one; a 25M-parameter GPT on 2 ranks gathers 180 MiB per step, which is
34 ms of faults in forward alone (ZeRO-3 bench, issue 18).

So on CPU the released memory is kept here, keyed by size, and handed to the next gather of a
buffer of that size by swapping data pointers: the buffer's storage object stays the same, so
the views autograd saved keep pointing at it, as with the resize. What is kept plus what is
gathered never exceeds the schedule's bound on gathered bytes (``Sharded.gathered_bound``),
which the estimator already counts, so the peak does not rise; between steps the kept memory
stays allocated and the memory report shows it (``gathered_cached``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

# A private torch method (its public users are ``torch.utils.swap_tensors`` and module
# loading); where it is missing, buffers are resized as before.
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class GatherMemory:
    """Freed full-buffer memory, by size in bytes: at most ``limit()`` bytes with what is in use
    (a function: mixed precision re-stores the buffers after the engine is built)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self._free: defaultdict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self.cached_bytes = 0

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cpu" and _SWAP

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory, kept memory first."""
        kept = self._free.get(nbytes)
        if kept:
            holder = kept.pop()
            storage._swap_data_ptr_(holder)  # type: ignore[attr-defined]
            self.cached_bytes -= nbytes
            return
        storage.resize_(nbytes)

    def take(self, storage: torch.UntypedStorage, in_use: int) -> None:
        """Leave ``storage`` empty: keep its memory if ``in_use`` gathered bytes plus what is
        kept leave room for it under ``limit()``, else free it."""
        nbytes = storage.nbytes()
        if nbytes and self.cached_bytes + in_use + nbytes <= self.limit():
            holder = torch.UntypedStorage(0, device=storage.device)
            holder._swap_data_ptr_(storage)  # type: ignore[attr-defined]
            self._free[nbytes].append(holder)
            self.cached_bytes += nbytes
            return
        storage.resize_(0)

    def clear(self) -> None:
        self._free.clear()
        self.cached_bytes = 0
