"""``GradSpill``: stage 3's reduced gradient shards on NVMe (``offload.gradients="nvme"``).

[Note: gradients on NVMe]
Without it every rank keeps its reduced gradient shard (Ψ/N elements in the compute dtype) in
device memory from the backward that produces it until the step: with the parameters and the
optimizer state on NVMe that shard is the one model-sized thing left on the device. With it,
the shard has no memory at all (``ShardedGrads`` keeps a meta tensor for its shape): each
reduce-scatter of a backward lands this rank's run of a bucket in its staging buffer as usual,
and ``land`` copies the averaged run into a slot of a small host ring (accumulating onto what a
file holds from an earlier synchronised backward of the same step, by reading it back first:
the same add the device shard would do), then a host worker writes the slot to the run's place
in one file, ``rank<r>-grads`` under ``offload.path`` ([Note: swap files]).

The file holds every bucket's owned region at an ALIGN boundary; the runs of a reduce start at
multiples of ALIGN elements within a region ([Note: stage-3 reduce chunks]: the chunk plan's
granule), and so do the offloaded step's chunks ([Note: offload chunks]), which read their
gradients back from the same places: every transfer is aligned, as O_DIRECT needs.

What the step must know before any update (a non-finite element anywhere, the global norm for
clipping) is taken from each run as the writer sees it, on the writer's thread: the non-finite
flag as ``torch.amp`` checks it, and the run's 2-norm. A run written twice in one step (a second
synchronised backward) replaces its norm; the flag only accumulates, which is exact because a
non-finite element stays non-finite whatever is added to it. A norm other than 2 reads the runs
back once. So the flag is the device check's, bit for bit; the norm sums the same squares
grouped by run instead of by parameter piece, which rounds differently in the last bits (the
reason clipped steps match the on-device run within fp32 tolerance, and unclipped ones exactly).
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import torch

from zerodp.offload.swapfile import SwapFile, aligned, aligned_empty
from zerodp.partition.segment import Segment
from zerodp.plan import Plan
from zerodp.streams import Event, StreamError, Streams

Run = tuple[int, int, int]  # (segment, bucket, first element in the owned region)


class GradSpill:
    def __init__(
        self,
        streams: Streams,
        directory: str,
        rank: int,
        segments: list[Segment],
        slots: int,
    ) -> None:
        self.streams = streams
        self.dtypes = [s.dtype for s in segments]
        self.bases: dict[tuple[int, int], int] = {}  # (segment, bucket) -> its region's offset
        offset = 0
        for i, seg in enumerate(segments):
            for b, bucket in enumerate(seg.layout.buckets):
                self.bases[(i, b)] = offset
                offset += aligned(bucket.shard_numel * seg.dtype.itemsize)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.file = SwapFile(directory, f"rank{rank}-grads", max(offset, 1))
        self.slots = slots
        self.ring: list[torch.Tensor] = []  # sized by ``reserve``
        self.busy: list[Event | None] = [None] * slots  # the last write out of each slot
        self.turn = 0
        self.writer = streams.host("grads-write")
        self._found = torch.zeros(1, dtype=torch.float32)  # written on the writer's thread
        self._one = torch.ones(1, dtype=torch.float32)
        self.runs: dict[Run, tuple[int, torch.Tensor]] = {}  # -> (elements, 2-norm)

    def reserve(self, run_numel: int) -> None:
        """The ring: ``slots`` aligned host buffers of the largest run (the reducer's plan)."""
        largest = max((d.itemsize for d in self.dtypes), default=4)
        self.ring = [
            aligned_empty(self.streams, aligned(max(1, run_numel) * largest))
            for _ in range(self.slots)
        ]

    def _place(self, run: Run) -> int:
        seg, bucket, start = run
        return self.bases[(seg, bucket)] + start * self.dtypes[seg].itemsize

    def _extent(self, slot: int, run: Run, numel: int) -> torch.Tensor:
        return self.ring[slot].narrow(0, 0, aligned(numel * self.dtypes[run[0]].itemsize))

    # -- during backward ------------------------------------------------------------------------

    def land(self, run: Run, value: torch.Tensor, *, accumulate: bool) -> None:
        """``value``: this rank's averaged reduction of ``run`` (in the reduce dtype); it becomes
        the run's gradient in the file (``accumulate``: added to the one there). Returns once
        ``value`` is no longer needed; the write goes on in the background."""
        slot = self.turn % len(self.ring)
        self.turn += 1
        busy = self.busy[slot]
        if busy is not None:
            busy.wait()
        numel = value.numel()
        dst = self.ring[slot].view(self.dtypes[run[0]]).narrow(0, 0, numel)
        extent = self._extent(slot, run, numel)
        if accumulate:
            self.writer.synchronize()  # what the earlier backward wrote there is on the file
            self.file.read(self._place(run), extent)
            dst.add_(value)  # the device shard's ``add_``: the same cast and sum
        else:
            dst.copy_(value)
        self.busy[slot] = self.writer.submit(partial(self._write, run, dst, extent))

    def _write(self, run: Run, dst: torch.Tensor, extent: torch.Tensor) -> None:
        torch._amp_foreach_non_finite_check_and_unscale_([dst], self._found, self._one)
        self.runs[run] = (dst.numel(), _norm(dst, 2.0))
        self.file.write(self._place(run), extent)

    # -- what the step asks -----------------------------------------------------------------------

    def settle(self) -> None:
        """Every run written (raises what a write raised)."""
        self.writer.synchronize()

    def nonfinite(self) -> bool:
        self.settle()
        return bool(self._found.item())

    def norms(self, norm_type: float) -> list[torch.Tensor]:
        """Each run's ``norm_type``-norm (fp32, on the host)."""
        self.settle()
        if norm_type == 2.0:
            return [norm for _, norm in self.runs.values()]
        out = []
        for run, (numel, _) in self.runs.items():  # read back through slot 0, now idle
            self.file.read(self._place(run), self._extent(0, run, numel))
            out.append(_norm(self.ring[0].view(self.dtypes[run[0]]).narrow(0, 0, numel), norm_type))
        return out

    def read(self, seg: int, bucket: int, start: int, numel: int, buf: torch.Tensor) -> None:
        """Elements ``[start, start + numel)`` of the bucket's owned region into the aligned
        host buffer ``buf`` (bytes), as ``self.dtypes[seg]``. On a host worker, after
        ``settle``."""
        nbytes = aligned(numel * self.dtypes[seg].itemsize)
        self.file.read(self._place((seg, bucket, start)), buf.narrow(0, 0, nbytes))

    def zero_grad(self) -> None:
        """A new step's gradients start: no run is written, nothing is non-finite."""
        self.settle()
        self.runs.clear()
        self._found.zero_()

    # -- accounting and teardown ------------------------------------------------------------------

    def io_bytes(self) -> tuple[int, int]:
        return self.file.bytes_read, self.file.bytes_written

    @property
    def host_nbytes(self) -> int:
        return sum(b.numel() for b in self.ring)

    @property
    def nvme_nbytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        with contextlib.suppress(StreamError):  # a failed write was raised where it happened
            self.writer.synchronize()
        self.file.close()


def _norm(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)


def make_spill(
    plan: Plan, streams: Streams, segments: list[Segment], rank: int
) -> GradSpill | None:
    """The plan's spill for stage 3's gradient shards; None when they stay on the device."""
    if plan.offload_gradients == "device":
        return None
    assert plan.offload_path is not None
    return GradSpill(streams, plan.offload_path, rank, segments, plan.offload_ring)
