"""Launched gradient reductions not waited for yet, and the staging buffers they hold.

Both reducers (``grads.reducer.GradReducer`` for stages 0-2, ``params.reduce.ShardedGrads`` for
stage 3) launch collectives asynchronously and finish them in launch order. A staging buffer is
only ever held by a launched collective, so when the pool is exhausted, waiting for the oldest
collective frees one: the pool's fixed size bounds the staging memory whatever the model size,
at the price of a wait when backward outruns the network.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerodp.comm import Handle
from zerodp.grads.staging import Staged, StagingPool


@dataclass(slots=True)
class _Launched:
    handle: Handle
    post: Callable[[], None]  # runs once the collective completed (average, copy, accumulate)
    staging: torch.Tensor | None  # returned to the pool after ``post``


class InFlight:
    """Launched collectives, oldest first, and the staging pool their buffers come from."""

    _pool: StagingPool | None  # None: nothing is staged (fp32 stages 0-1 reduce in place)
    _queue: deque[_Launched]

    def __init__(self, pool: StagingPool | None) -> None:
        self._pool = pool
        self._queue = deque()

    def acquire(self, numel: int) -> Staged:
        """A staging view of ``numel`` elements (and its receive buffer); waits for the oldest
        launched collective while every buffer is taken."""
        assert self._pool is not None
        while not self._pool.available and self._queue:
            self.wait_oldest()
        return self._pool.acquire(numel)

    def push(
        self, handle: Handle, post: Callable[[], None], staging: torch.Tensor | None = None
    ) -> None:
        """Record a launched collective: once it completes, ``post`` runs and ``staging`` (if
        the collective used one) goes back to the pool."""
        self._queue.append(_Launched(handle, post, staging))

    def wait_oldest(self) -> None:
        item = self._queue.popleft()
        item.handle.wait()
        item.post()
        if item.staging is not None:
            assert self._pool is not None
            self._pool.release(item.staging)

    def wait_all(self) -> None:
        """Wait for every launched collective, oldest first (before the step reads the
        gradients, and before anything zeroes a buffer a collective may still be writing)."""
        while self._queue:
            self.wait_oldest()

    @property
    def staging_bytes(self) -> int:
        return self._pool.nbytes if self._pool is not None else 0
