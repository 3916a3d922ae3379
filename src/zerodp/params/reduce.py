"""Stage-3 gradient reduction: one reduce-scatter per unit, right after its backward.

``ShardedGrads`` is the engine's ``reducer`` under stage 3 (the same interface as
``grads.reducer.GradReducer``). It does not decide *when* a unit is reduced: the schedule
(``hooks.py``) calls ``reduce_unit`` at the unit's post-backward, and ``end_backward`` at the end
of backward for every unit not reduced yet (unused units, units whose inputs need no gradient)
and for the persistent segments, in a fixed order. Those trigger points depend on the autograd
graph only, not on which parameters happened to receive a gradient, so every rank issues its
reduce-scatters at the same points relative to its all-gathers (unlike stages 0-2, whose
bucket-completion trigger may differ between ranks; there only reductions share the group).

A launch copies the segment's gradients into a staging buffer in the reduce dtype (zeros for
parameters without one), frees ``param.grad``, and reduce-scatters into this rank's gradient
shard (in the compute dtype), dividing by N and accumulating over synchronised backwards, exactly
as stage 2's ``SCATTER_STAGED`` does, so the numerics match stages 0-2 bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerodp.comm import Communicator, Handle
from zerodp.grads.staging import StagingPool, reduce_scatter_into, zero_range
from zerodp.params.order import Op, OrderCheck
from zerodp.partition.segment import Segment


@dataclass(slots=True)
class _InFlight:
    handle: Handle
    post: Callable[[], None]


class ShardedGrads:
    """Gradient shards and their reduction for every stage-3 segment of one engine."""

    def __init__(
        self,
        segments: list[Segment],
        comm: Communicator,
        check: OrderCheck,
        check_ids: list[int],  # per segment: the index OrderCheck names it by
        reduce_dtype: torch.dtype | None,
        staging_buffers: int = 2,
    ) -> None:
        self.segments = segments
        self.comm = comm
        self.check = check
        self.check_ids = check_ids
        self.world = comm.world_size
        self.sync_enabled = True
        self._convert = [reduce_dtype is not None and s.dtype != reduce_dtype for s in segments]
        # Not zero-filled: the first reduce-scatter of a round writes every element (see
        # ``_has_data``), and nothing reads a shard before that. So they cost no memory until
        # the first backward (a model built only for inference never touches them).
        self.shard_grads = [
            torch.empty(s.layout.shard_numel, dtype=s.dtype, device=s.device) for s in segments
        ]
        numels = [b.numel for s in segments for b in s.layout.buckets]
        self._pool = (
            StagingPool(
                numels,
                self.world,
                reduce_dtype or segments[0].dtype,
                segments[0].device,
                staging_buffers,
                with_scratch=False,
            )
            if segments
            else None
        )
        self.used: list[list[bool]] = [[False] * len(s.params) for s in segments]
        self._has_data = [[False] * len(s.layout.buckets) for s in segments]
        self._inflight: deque[_InFlight] = deque()
        self.rounds = 0  # synchronised reduction rounds since zero_grad
        self._averaged = False

    # -- launching (called by the schedule) ----------------------------------------------------

    def reduce(self, seg_id: int) -> None:
        seg = self.segments[seg_id]
        if not seg.layout.buckets:
            return
        self.check(Op.REDUCE, self.check_ids[seg_id])
        for b in range(len(seg.layout.buckets)):
            self._launch(seg_id, b)

    def end_round(self) -> None:
        self.rounds += 1

    def _launch(self, seg_id: int, b: int) -> None:
        seg = self.segments[seg_id]
        lay = seg.layout
        staging, _ = self._acquire(lay.buckets[b].numel)
        self._fill(seg_id, b, staging)
        owned = lay.bucket_shard(b, self.comm.rank)
        target = self.shard_grads[seg_id].narrow(0, lay.bucket_shard_offset(b), owned.numel)
        handle, average = reduce_scatter_into(
            self.comm,
            staging,
            target,
            accumulate=self._has_data[seg_id][b],
            convert=self._convert[seg_id],
        )
        self._has_data[seg_id][b] = True

        def post() -> None:
            average()
            self._release(staging)

        self._inflight.append(_InFlight(handle, post))

    def _fill(self, seg_id: int, b: int, staging: torch.Tensor) -> None:
        """The bucket's part of every gradient (zeros where none), then free the gradients of
        parameters whose last bucket this is."""
        seg = self.segments[seg_id]
        bucket = seg.layout.buckets[b]
        cursor = bucket.start
        for s in seg.layout.bucket_slots[b]:
            slot = seg.layout.slots[s]
            part = slot.flat.intersect(bucket)
            assert part is not None
            zero_range(staging, cursor - bucket.start, part.start - bucket.start)
            dst = staging.narrow(0, part.start - bucket.start, part.numel)
            p = seg.params[s]
            grad = p.grad
            if grad is None:
                dst.zero_()
            else:
                self.used[seg_id][s] = True
                dst.copy_(grad.reshape(-1).narrow(0, part.start - slot.flat.start, part.numel))
                if part.stop == slot.flat.stop:
                    p.grad = None
            cursor = part.stop
        zero_range(staging, cursor - bucket.start, bucket.numel)

    def _acquire(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._pool is not None
        while not self._pool.available and self._inflight:
            self._wait_oldest()
        return self._pool.acquire(numel, self.world)

    def _release(self, staging: torch.Tensor) -> None:
        assert self._pool is not None
        self._pool.release(staging)

    def _wait_oldest(self) -> None:
        item = self._inflight.popleft()
        item.handle.wait()
        item.post()

    # -- the engine's reducer interface ----------------------------------------------------------

    def finish(self) -> None:
        """Make the step's gradients final: reduce every segment (in order) if no synchronised
        backward did (e.g. only ``no_sync`` backwards ran), agree with every rank that all are
        at the step, wait for every reduce-scatter. Idempotent until ``zero_grad``."""
        if self._averaged:
            return
        if self.rounds == 0:
            for i in range(len(self.segments)):
                self.reduce(i)
            self.end_round()
        self.check(Op.STEP)
        while self._inflight:
            self._wait_oldest()
        self._averaged = True

    def zero_grad(self) -> None:
        while self._inflight:  # never zero a buffer a collective is still writing
            self._wait_oldest()
        for seg in self.segments:
            for p in seg.params:
                p.grad = None
        self._has_data = [[False] * len(s.layout.buckets) for s in self.segments]
        self.used = [[False] * len(s.params) for s in self.segments]
        self.rounds = 0
        self._averaged = False

    def grad_storage(self, seg: int) -> tuple[torch.Tensor, bool]:
        return self.shard_grads[seg], True

    def buffer_bytes(self) -> int:
        return self._pool.nbytes if self._pool is not None else 0

    def gradient_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shard_grads)

    def remove_hooks(self) -> None:
        """Hooks are owned by the schedule (``ShardedParams.remove``)."""
