"""Stage-3 gradient reduction: one reduce-scatter per unit, right after its backward.

``ShardedGrads`` is the engine's ``reducer`` under stage 3 (the same interface as
``grads.reducer.GradReducer``). It does not decide *when* a unit is reduced: the schedule
(``hooks.py``) calls ``reduce_unit`` at the unit's post-backward, and ``end_backward`` at the end
of backward for every unit not reduced yet (unused units, units whose inputs need no gradient)
and for the persistent segments, in a fixed order. Those trigger points depend on the autograd
graph only, not on which parameters happened to receive a gradient, so every rank issues its
reduce-scatters at the same points relative to its all-gathers (unlike stages 0-2, whose
bucket-completion trigger may differ between ranks; there only reductions share the group).

[Note: stage-3 reduce chunks]
A unit's reduce-scatter is issued in *chunks* of at most ``bucket_bytes`` (rounded down to a
multiple of N x alignment, like a stage-2 bucket), so the staging memory is a fixed pool of two
chunk-sized buffers whatever the size of the largest unit (ZeRO-R's constant-size buffers).
Rank r owns the contiguous r-th 1/N of a unit ([Note: sharded storage]); chunk k gathers, for
every rank r, the k-th run of ``c`` elements of r's slice (``c`` = chunk / N), one after the
other, so one plain equal-chunk reduce-scatter of the staging buffer lands the k-th run of
every rank's shard gradient in place. The chunks of a unit partition its padded flat space, so
the traffic is the same as one reduce-scatter of the whole unit (only the number of calls
grows); a unit no larger than a chunk is one reduce-scatter, as before.
With the gradient shards on NVMe ([Note: gradients on NVMe] in offload/grad_spill.py) every run
is also a whole number of ALIGN (4096) elements per rank but the last of a bucket, so each one
starts at an aligned place in the file; a small model's runs are then larger than a bucket.

A launch copies a chunk's gradients into a staging buffer in the reduce dtype (zeros for
parameters without one), frees ``param.grad`` once every element of it was copied, and
reduce-scatters into this rank's gradient shard (in the compute dtype), dividing by N and
accumulating over synchronised backwards, exactly as stage 2's ``SCATTER_STAGED`` does, so the
numerics match stages 0-2 bit for bit. Where the reduce-scatter runs point to point (gloo on
CPU) and needs no conversion nor spill, nothing is copied: each gradient's part of a chunk is
sent as it lies ([Note: reduce-scatter from pieces] in comm/gloo_cpu.py), with the same sums,
and a gradient's memory is held until its reduce-scatter completed (not until it was staged).
The pool's receive buffer is used, its staging view is not (the pool keeps its size, so
``comm_buffers`` is the same on every path).
"""

from __future__ import annotations

import math
from bisect import bisect_right

import torch

from zerodp.comm import Communicator, Piece, gaps
from zerodp.grads.inflight import InFlight
from zerodp.grads.staging import (
    Staged,
    average,
    reduce_scatter_into,
    staging_pool,
)
from zerodp.offload.grad_spill import GradSpill
from zerodp.offload.swapfile import ALIGN
from zerodp.params.order import Op, OrderCheck
from zerodp.partition.buffers import OwnedStorage, ShardBuffer
from zerodp.partition.layout import FlatLayout, Range
from zerodp.partition.segment import Segment


class ShardedGrads:
    """Gradient shards and their reduction for every stage-3 segment of one engine."""

    def __init__(
        self,
        segments: list[Segment],
        comm: Communicator,
        check: OrderCheck,
        check_ids: list[int],  # per segment: the index OrderCheck names it by
        reduce_dtype: torch.dtype | None,
        chunk_numels: list[int] | None = None,  # per segment: most elements per reduce-scatter
        staging_buffers: int = 2,
        spill: GradSpill | None = None,
    ) -> None:
        self.segments = segments
        self.spill = spill  # [Note: gradients on NVMe]: no shard in memory
        self.comm = comm
        self.check = check
        self.check_ids = check_ids
        self.world = comm.world_size
        self.sync_enabled = True
        self._convert = [reduce_dtype is not None and s.dtype != reduce_dtype for s in segments]
        # Not zero-filled: the first reduce-scatter of a round writes every element (see
        # ``_has_data``), and nothing reads a shard before that. So they cost no memory until
        # the first backward (a model built only for inference never touches them).
        where = [torch.device("meta") if spill else s.device for s in segments]
        self.shard_grads = [
            torch.empty(s.layout.shard_numel, dtype=s.dtype, device=d)
            for s, d in zip(segments, where, strict=True)
        ]
        self._storages: list[OwnedStorage] = [
            ShardBuffer(t, s.layout, comm.rank)
            for t, s in zip(self.shard_grads, segments, strict=True)
        ]
        # Per segment: (bucket, offset in the rank's slice of it, elements per rank) of every
        # reduce-scatter; see [Note: stage-3 reduce chunks]. On NVMe every run starts at a
        # whole number of ALIGN elements: an aligned place in the file.
        granule = ALIGN if spill else 1
        self._chunks = [
            chunk_plan(s.layout, chunk_numels[i] if chunk_numels else None, granule)
            for i, s in enumerate(segments)
        ]
        self._stops = [[slot.flat.stop for slot in s.layout.slots] for s in segments]
        numels = [n * self.world for plan in self._chunks for _, _, n in plan]
        if spill is not None:
            spill.reserve(max(numels, default=0) // self.world)
        self._inflight = InFlight(
            staging_pool(numels, comm, segments, reduce_dtype, staging_buffers)
        )
        self.used: list[list[bool]] = [[False] * len(s.params) for s in segments]
        self.grads_seen = 0  # gradients staged, ever: "did a backward run" (engine)
        self._has_data = [[False] * len(s.layout.buckets) for s in segments]
        self.rounds = 0  # synchronised reduction rounds since zero_grad
        self._averaged = False

    # -- launching (called by the schedule) ----------------------------------------------------

    def reduce_plan(self, seg_id: int) -> list[tuple[Op, int]]:
        """The checked collectives ``reduce(seg_id)`` will issue (``OrderCheck.approve``)."""
        if not self.segments[seg_id].layout.buckets:
            return []
        return [(Op.REDUCE, self.check_ids[seg_id])]

    def reduce(self, seg_id: int, checked: bool = True) -> None:
        """Reduce-scatter segment ``seg_id``'s gradients (zeros for parameters without one);
        ``checked=False``: the caller agreed on it (a unit's segments, under one check)."""
        seg = self.segments[seg_id]
        if not seg.layout.buckets:
            return
        if checked:
            self.check(Op.REDUCE, self.check_ids[seg_id])
        left = {s.index: s.flat.numel for s in seg.layout.slots}  # elements not staged yet
        for b, offset, numel in self._chunks[seg_id]:
            self._launch(seg_id, b, offset, numel, left)
        for b in range(len(seg.layout.buckets)):
            self._has_data[seg_id][b] = True
        if checked:
            self.check.issue_extras()

    def reduce_zeros(self, seg_id: int) -> None:
        """Take part in ``reduce(seg_id)``'s reduce-scatters with zeros and wait for them,
        changing no gradient here: standing in after ranks diverged ([Note: verified orders]
        in params/replay.py)."""
        chunks = self._chunks[seg_id] if self.segments[seg_id].layout.buckets else []
        for b, offset, numel in chunks:
            staged = self._inflight.acquire(numel * self.world)
            received = self._pieces_receive(seg_id, staged)
            if received is not None:  # the same messages as the ranks that reduce
                zeros = self._pieces(seg_id, b, offset, numel, None)
                handle, _ = self.comm.reduce_scatter_pieces(zeros, numel, received)
                self._inflight.push(handle, _no_post, staged.data)
                continue
            staging = staged.data.zero_()
            own = staging.narrow(0, self.comm.rank * numel, numel)
            handle = self.comm.reduce_scatter(own, staging, received=staged.received, async_op=True)
            self._inflight.push(handle, _no_post, staging)
        self._inflight.wait_all()

    def end_round(self) -> None:
        self.rounds += 1

    def _launch(self, seg_id: int, b: int, offset: int, numel: int, left: dict[int, int]) -> None:
        lay = self.segments[seg_id].layout
        staged = self._inflight.acquire(numel * self.world)
        start = lay.buckets[b].shard_offset + offset
        target = self.shard_grads[seg_id].narrow(0, start, numel)
        accumulate = self._has_data[seg_id][b]
        received = self._pieces_receive(seg_id, staged)
        if received is not None:
            chunks = self._pieces(seg_id, b, offset, numel, left)
            handle, total = self.comm.reduce_scatter_pieces(chunks, numel, received)

            def post() -> None:
                average(total, target, accumulate=accumulate, world=self.world)

            self._inflight.push(handle, post, staged.data)
            return
        self._fill(seg_id, b, offset, numel, staged.data, left)
        if self.spill is not None:
            self._launch_spilled(seg_id, b, offset, staged)
            return
        handle, post = reduce_scatter_into(
            self.comm, staged, target, accumulate=accumulate, convert=self._convert[seg_id]
        )
        self._inflight.push(handle, post, staged.data)

    def _pieces_receive(self, seg_id: int, staged: Staged) -> torch.Tensor | None:
        """Where a reduce-scatter of ``seg_id`` going straight from the gradients receives
        ([Note: reduce-scatter from pieces] in comm/gloo_cpu.py); None where it is staged. Only
        the receive buffer behind the staging view is used: point to point, with no conversion
        nor spill (the same on every rank: the configuration decides)."""
        if self.spill is not None or self._convert[seg_id]:
            return None
        return staged.received

    def _launch_spilled(self, seg_id: int, b: int, offset: int, staged: Staged) -> None:
        """The reduction lands in this rank's chunk of the staging buffer, averaged there and
        handed to the spill: the ops of ``reduce_scatter_into`` when it accumulates."""
        spill = self.spill
        assert spill is not None
        staging = staged.data
        numel = staging.numel() // self.world
        own = staging.narrow(0, self.comm.rank * numel, numel)
        handle = self.comm.reduce_scatter(own, staging, received=staged.received, async_op=True)
        accumulate = self._has_data[seg_id][b]

        def land() -> None:
            own.div_(self.world)
            spill.land((seg_id, b, offset), own, accumulate=accumulate)

        self._inflight.push(handle, land, staging)

    def _fill(
        self,
        seg_id: int,
        b: int,
        offset: int,
        numel: int,
        staging: torch.Tensor,
        left: dict[int, int],
    ) -> None:
        """For every rank r, the run ``[offset, offset + numel)`` of r's slice of bucket ``b``
        into ``staging[r * numel:]``: each parameter's part of it (zeros where none)."""
        for r, pieces in enumerate(self._pieces(seg_id, b, offset, numel, left)):
            dst = staging.narrow(0, r * numel, numel)
            for start, stop in gaps(pieces, numel):
                dst[start:stop].zero_()
            for piece in pieces:
                part = dst.narrow(0, piece.offset, piece.numel)
                if piece.tensor is None:
                    part.zero_()
                else:
                    part.copy_(piece.tensor)

    def _pieces(
        self, seg_id: int, b: int, offset: int, numel: int, left: dict[int, int] | None
    ) -> list[list[Piece]]:
        """For every rank r, the parameters' parts of the run ``[offset, offset + numel)`` of
        r's slice of bucket ``b``: their gradients' views (None where a parameter has none, and
        everywhere when ``left`` is None: zeros), at their offsets in the run. Drops
        ``param.grad`` once every element of it was taken (the views keep its memory until
        they are done with)."""
        seg = self.segments[seg_id]
        lay = seg.layout
        stops = self._stops[seg_id]
        out: list[list[Piece]] = []
        for r in range(self.world):
            run = lay.buckets[b].shard(r)
            run = Range(run.start + offset, run.start + offset + numel)
            pieces: list[Piece] = []
            s = bisect_right(stops, run.start)  # the first slot ending after run.start
            while s < len(lay.slots) and lay.slots[s].flat.start < run.stop:
                part = lay.slots[s].flat.intersect(run)
                if part is not None:
                    grad = None if left is None else self._take(seg_id, s, part, left)
                    pieces.append(Piece(part.start - run.start, part.numel, grad))
                s += 1
            out.append(pieces)
        return out

    def _take(self, seg_id: int, s: int, part: Range, left: dict[int, int]) -> torch.Tensor | None:
        """Parameter ``s``'s gradient over ``part`` of the flat space, flat (None: it has
        none)."""
        seg = self.segments[seg_id]
        p = seg.params[s]
        grad = p.grad
        left[s] -= part.numel
        if left[s] == 0:
            p.grad = None
        if grad is None:
            return None
        self.used[seg_id][s] = True
        self.grads_seen += 1
        start = part.start - seg.layout.slots[s].flat.start
        return grad.reshape(-1).narrow(0, start, part.numel)

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
        self._inflight.wait_all()
        self._averaged = True

    def open_backward(self) -> None:
        """A backward starts: after ``finish`` with no ``zero_grad`` it adds to the averaged
        shards, which a new round reduces correctly ([Note: accumulating across steps] in
        grads/reducer.py)."""
        if self._averaged:
            self._averaged = False
            self.rounds = 0

    def zero_grad(self) -> None:
        self._inflight.wait_all()  # never zero a buffer a collective is still writing
        for seg in self.segments:
            for p in seg.params:
                p.grad = None
        self._has_data = [[False] * len(s.layout.buckets) for s in self.segments]
        self.used = [[False] * len(s.params) for s in self.segments]
        self.rounds = 0
        self._averaged = False
        if self.spill is not None:
            self.spill.zero_grad()

    def grad_storage(self, seg: int) -> OwnedStorage:
        return self._storages[seg]

    def buffer_bytes(self) -> int:
        return self._inflight.staging_bytes

    def gradient_bytes(self) -> int:
        """In memory (on NVMe: none; the file is the spill's)."""
        return sum(t.numel() * t.element_size() for t in self.shard_grads if not t.is_meta)

    def remove_hooks(self) -> None:
        """Hooks are owned by the schedule (``ShardedParams.remove``)."""


def chunk_plan(
    layout: FlatLayout, chunk_numel: int | None, granule: int = 1
) -> list[tuple[int, int, int]]:
    """The reduce-scatters of one segment, as (bucket, offset in each rank's slice of it,
    elements per rank): each bucket cut into runs of at most ``chunk_numel // N`` elements per
    rank (rounded down to the alignment and to ``granule`` elements, but at least one of
    those; None: whole buckets). See [Note: stage-3 reduce chunks]."""
    n, align = layout.world_size, math.lcm(layout.align, granule)
    out: list[tuple[int, int, int]] = []
    for bucket in layout.buckets:
        size, b = bucket.shard_numel, bucket.index
        step = size if chunk_numel is None else max(align, chunk_numel // (n * align) * align)
        out += [(b, off, min(step, size - off)) for off in range(0, size, step)]
    return out


def _no_post() -> None:
    pass
