"""``GradSync``: what the engine needs from a gradient synchroniser, whichever stage.

Two implement it: ``grads.reducer.GradReducer`` (stages 0-2: buckets launched by per-parameter
hooks, all-reduce or reduce-scatter) and ``params.reduce.ShardedGrads`` (stage 3: per-unit
reduce-scatters launched by the unit schedule). The engine, the step runners and the memory
report see only this protocol.
"""

from __future__ import annotations

from typing import Protocol

from zerodp.partition.buffers import OwnedStorage


class GradSync(Protocol):
    used: list[list[bool]]  # per segment, per parameter: got a gradient since zero_grad
    grads_seen: int  # gradients produced, ever: "did a backward run" between two steps
    sync_enabled: bool  # False inside ``no_sync``: gradients accumulate locally

    def finish(self) -> None:
        """Make the step's gradients final (reduced, averaged); on every rank at the same
        point. Idempotent until ``zero_grad``."""

    def zero_grad(self) -> None: ...

    def grad_storage(self, seg: int) -> OwnedStorage:
        """Segment ``seg``'s reduced gradients ([Note: flat and shard buffers])."""

    def buffer_bytes(self) -> int:
        """Communication buffers held (staging)."""

    def gradient_bytes(self) -> int:
        """Gradient storage held (full buffers or owned shards)."""

    def remove_hooks(self) -> None: ...
