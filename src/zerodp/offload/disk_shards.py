"""``DiskShards``: stage 3's parameter shards in a file (``offload.params="nvme"``).

[Note: parameters on NVMe]
One file per rank (``rank<r>-params``, a ``SwapFile``: [Note: swap files]) holds every unit
shard at its own 4 KiB-aligned extent, in the compute dtype; between gathers each
``ShardedSegment.shard`` is an empty tensor and no host memory holds parameters. ``slots`` aligned
host buffers (``offload.ring_buckets``, each the largest shard) carry the reads:

- ``stage`` (a gather, on the caller's thread) takes the shard's slot if it was read ahead, else
  reads it now, copies it to the device and frees the slot once that copy is done;
- then it reads ahead, on the ``params-read`` worker, the next shards of the order recorded in
  the previous step (``PassOrder``: the same predictor as the unit prefetch, over the whole
  step's sequence of gathers, forward and backward), into the free slots. A read that follows
  an update waits, on the worker, for that update's write ([Note: offloaded step]); a wrong guess
  costs one read, never a stale value;
- ``invalidate`` (a step starts) drops what was read ahead, which the step is about to change.

The step's ``land`` casts a bucket's updated masters into an aligned outgoing ring slot and
writes it on the ``params-write`` worker; the gather of that unit waits for the write (through
``Landing``), and a read of it is queued after it. ``resident`` reads every shard into a host
tensor for code that uses them as tensors (checkpoint loads, write-back) and writes them back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

from zerodp.offload.chunks import HostChunk
from zerodp.offload.landing import Landing
from zerodp.offload.swapfile import SwapFile, aligned, aligned_empty
from zerodp.params.prefetch import PassOrder
from zerodp.params.segment import ShardedSegment
from zerodp.streams import Event, StreamError

Part = tuple[int, int]  # (segment, part): ``slot_bytes`` of its extent


class DiskShards:
    tier = "nvme"
    aligned = True

    def __init__(
        self,
        landing: Landing,
        directory: str,
        rank: int,
        segments: list[ShardedSegment],
        slots: int,
        slot_bytes: int,
    ) -> None:
        self.landing = landing
        self.streams = landing.streams
        self.segments = {seg.index: seg for seg in segments}
        self.offsets: dict[int, int] = {}
        offset = 0
        for seg in segments:
            self.offsets[seg.index] = offset
            offset += aligned(seg.shard_numel_bytes)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.file = SwapFile(directory, f"rank{rank}-params", offset)
        largest = max(aligned(seg.shard_numel_bytes) for seg in segments)
        self.slot_bytes = min(aligned(slot_bytes), largest)  # a unit larger is read in parts
        self.ring = [aligned_empty(self.streams, self.slot_bytes) for _ in range(slots)]
        self.busy: list[Event | None] = [None] * slots  # the last copy out of each slot
        self.cache: dict[Part, tuple[int, Event]] = {}  # read ahead: (slot, its read)
        self.free = list(range(slots))
        self.order = PassOrder(slots)
        self._pass_limit = 4 * len(segments) + 8  # inference never ends a pass with a step
        self.reader = self.streams.host("params-read")
        self.writer = self.streams.host("params-write")
        self._resident = False
        self.hits = self.misses = 0  # parts gathered from a read ahead, and the others
        for seg in segments:
            self._write_tensor(seg.index, seg.shard)
            seg.shard = _empty_like(seg)

    def _parts(self, index: int) -> range:
        return range(-(-aligned(self.segments[index].shard_numel_bytes) // self.slot_bytes))

    def _part(self, index: int, part: int) -> tuple[int, int, int, int]:
        """Part ``part`` of segment ``index``: (its byte offset in the file, the bytes one
        aligned transfer moves, its first element in the shard, its elements)."""
        seg = self.segments[index]
        start = part * self.slot_bytes
        size = min(self.slot_bytes, aligned(seg.shard_numel_bytes) - start)
        per_part = self.slot_bytes // seg.dtype.itemsize
        first = part * per_part
        return (
            self.offsets[index] + start,
            size,
            first,
            min(per_part, seg.layout.shard_numel - first),
        )

    # -- gathers -----------------------------------------------------------------------------

    def holds(self, seg: int) -> bool:
        return seg in self.segments

    def stage(self, seg: ShardedSegment, dst: torch.Tensor) -> None:
        if self._resident:
            dst.copy_(seg.shard)
            return
        upcoming = self.order.visit(seg.index)
        if len(self.order.current) > self._pass_limit:
            self.order.end()
        parts = [(seg.index, p) for p in self._parts(seg.index)]
        ahead = [(i, p) for i in upcoming for p in self._parts(i)]
        for k, key in enumerate(parts):
            entry = self.cache.pop(key, None)
            self.hits += entry is not None
            self.misses += entry is None
            slot, read = entry or self._read(key)
            self._read_ahead(parts[k + 1 :] + ahead)
            read.wait()
            _, _, first, numel = self._part(*key)
            src = self.ring[slot].view(seg.dtype).narrow(0, 0, numel)
            copy = partial(_copy, dst.narrow(0, first, numel), src)
            self.busy[slot] = self.streams.compute.submit(copy, uses=[src])
            self.free.append(slot)

    def _read_ahead(self, wanted: list[Part]) -> None:
        """Into the free slots, in order."""
        for key in wanted:
            if not self.free:
                return
            if key not in self.cache:
                self.cache[key] = self._read(key)

    def _read(self, key: Part) -> tuple[int, Event]:
        """Queue the read of a part into a free slot (or the oldest read ahead's)."""
        if not self.free:
            oldest = next(iter(self.cache))
            slot, read = self.cache.pop(oldest)
            read.wait()
            self.free.append(slot)
        slot = self.free.pop(0)
        stepped = self.landing.pending_events(key[0])
        work = partial(self._read_into, key, slot, stepped, self.busy[slot])
        return slot, self.reader.submit(work)

    def _read_into(self, key: Part, slot: int, stepped: list[Event], busy: Event | None) -> None:
        for event in stepped:  # the update of the shard, then its write
            written = event.result()
            if written is not None:
                written.wait()
        if busy is not None:  # the last copy out of the slot
            busy.wait()
        offset, size, _, _ = self._part(*key)
        self.file.read(offset, self.ring[slot].narrow(0, 0, size))

    def invalidate(self) -> None:
        for slot, read in self.cache.values():
            read.wait()
            self.free.append(slot)
        self.cache.clear()
        self.order.end()

    # -- the step (on the optimizer's worker) -----------------------------------------------------

    def land(self, chunk: HostChunk, masters: torch.Tensor, slot: torch.Tensor) -> Event:
        """Into the chunk's place in the shard's extent: chunks start at multiples of a whole
        number of ALIGN blocks ([Note: offload chunks]), so the write is aligned; the last one
        ends at most at the extent's end."""
        shard = self.segments[chunk.seg]
        slot.view(shard.dtype).narrow(0, 0, chunk.numel).copy_(masters)  # the cast
        start = shard.layout.buckets[chunk.bucket].shard_offset + chunk.start
        offset = self.offsets[chunk.seg] + start * shard.dtype.itemsize
        extent = slot.narrow(0, 0, aligned(chunk.numel * shard.dtype.itemsize))
        return self.writer.submit(partial(self.file.write, offset, extent))

    # -- outside the step ---------------------------------------------------------------------

    def _write_tensor(self, index: int, shard: torch.Tensor) -> None:
        """Synchronously, through slot 0 (nothing else uses the ring then)."""
        self._through_slot0(index, shard, write=True)

    def _through_slot0(self, index: int, shard: torch.Tensor, *, write: bool) -> None:
        """Write ``shard`` to, or read it from, its extent, part by part through slot 0."""
        self._quiet_slot(0)
        for part in self._parts(index):
            offset, size, first, numel = self._part(index, part)
            raw = self.ring[0].narrow(0, 0, size)
            view = self.ring[0].view(shard.dtype).narrow(0, 0, numel)
            mine = shard.narrow(0, first, numel)
            if write:
                view.copy_(mine)
                self.file.write(offset, raw)
            else:
                self.file.read(offset, raw)
                mine.copy_(view)

    def _quiet_slot(self, slot: int) -> None:
        busy = self.busy[slot]
        if busy is not None:
            busy.wait()
            self.busy[slot] = None

    @contextmanager
    def resident(self, *, write: bool) -> Iterator[None]:
        if self._resident:
            yield
            return
        self.invalidate()
        self.writer.synchronize()  # the last step's writes (raises what failed)
        for index, seg in self.segments.items():
            seg.shard = torch.empty(seg.layout.shard_numel, dtype=seg.dtype)
            self._through_slot0(index, seg.shard, write=False)
        self._resident = True
        try:
            yield
        finally:
            self._resident = False
            for index, seg in self.segments.items():
                if write:
                    self._write_tensor(index, seg.shard)
                seg.shard = _empty_like(seg)

    # -- accounting and teardown --------------------------------------------------------------

    def io_bytes(self) -> tuple[int, int]:
        return self.file.bytes_read, self.file.bytes_written

    @property
    def host_nbytes(self) -> int:
        return sum(b.numel() for b in self.ring)

    @property
    def nvme_nbytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        for worker in (self.reader, self.writer):
            # A failure was raised where it happened (``Landing``); the file goes regardless.
            with contextlib.suppress(StreamError):
                worker.synchronize()
        self.file.close()


def _empty_like(seg: ShardedSegment) -> torch.Tensor:
    return torch.empty(0, dtype=seg.dtype, device="cpu")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` returning nothing: an event keeps what its work returned, and ``copy_``
    returns ``dst``, a view that would keep a gather's fresh buffer (``full_parameters``) alive
    for as long as the slot's event is kept."""
    dst.copy_(src, non_blocking=True)
