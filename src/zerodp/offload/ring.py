"""``TransferRing``: a fixed number of host buffers that copies to and from the device cycle
through (pinned on CUDA, so the copies are asynchronous and at full bandwidth).

Bounded by construction: ``slots`` buffers of the largest transfer, whatever the model size, so
offloading never pins a full copy of the model states (pinned memory cannot be paged out, and
full pinned copies are how offloaded runs of other systems exhaust host memory). Whoever fills
slot ``k % slots`` first waits for the work that last used it; the ring only hands out views.
"""

from __future__ import annotations

import torch

from zerodp.offload import swapfile
from zerodp.streams import Streams


class TransferRing:
    def __init__(self, streams: Streams, slots: int, max_numel: int, aligned: bool = False) -> None:
        # Bytes, viewed as each transfer's dtype: one ring serves fp32 and low-precision buckets.
        # ``aligned``: whole ALIGN blocks at ALIGN boundaries, for O_DIRECT writes (swapfile.py).
        self._bytes = 4 * max(1, max_numel)
        if aligned:
            self._bytes = swapfile.aligned(self._bytes)
            self._buffers = [swapfile.aligned_empty(streams, self._bytes) for _ in range(slots)]
        else:
            self._buffers = [streams.host_empty(self._bytes, torch.uint8) for _ in range(slots)]

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def view(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``k % slots`` as ``numel`` elements of ``dtype``."""
        return self._buffers[k % self.slots].view(dtype).narrow(0, 0, numel)

    def raw(self, k: int) -> torch.Tensor:
        """Slot ``k % slots``: all its bytes."""
        return self._buffers[k % self.slots]

    @property
    def nbytes(self) -> int:
        return self._bytes * self.slots
