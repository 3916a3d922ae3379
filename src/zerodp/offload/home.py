"""``ShardHome``: where stage 3's parameter shards rest between gathers (``offload.params``).

[Note: offloaded parameters]
Without parameter offload a unit's shard (this rank's 1/N of it, in the compute dtype) stays on
the device and is the all-gather's input. With ``ZeroConfig.offload.params`` it rests in host
memory (``"cpu"``: ``HostShards``, pinned on CUDA) or in a file under ``offload.path``
(``"nvme"``: ``DiskShards``, [Note: parameters on NVMe] in disk_shards.py), and the device holds
only the units gathered now. The gather of a unit ``stage``s its shard into the owned slice of
the unit's full buffer on the device, then all-gathers in place (``Gatherer``); the offloaded
step ([Note: offloaded step] in runner.py) hands each updated bucket of masters to ``land``,
which writes it into the shard's home instead of copying it to the device, and returns the
event a gather of that unit must wait for (``Landing``).

Parameter offload needs optimizer offload (``OffloadConfig`` refuses it alone): the masters
that the step updates must not sit on the device that the parameters left.

Outside the step, whatever reads or writes the shards as tensors (a checkpoint load's
``publish``, a write-back of edited full parameters) runs inside ``resident(write=...)``,
where every ``ShardedSegment.shard`` is a host tensor (on NVMe: read in for the duration).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Protocol

import torch

from zerodp.offload.chunks import HostChunk, chunk_numel
from zerodp.offload.disk_shards import DiskShards
from zerodp.offload.landing import Landing
from zerodp.params.segment import ShardedSegment
from zerodp.plan import Plan
from zerodp.streams import Event, Streams


class ShardHome(Protocol):
    tier: str  # "cpu" or "nvme"
    aligned: bool  # ``land``'s slot must be an aligned host buffer (O_DIRECT writes)

    def holds(self, seg: int) -> bool:
        """Whether segment ``seg`` is a unit shard of this home (persistent segments stay on
        the device)."""

    def stage(self, seg: ShardedSegment, dst: torch.Tensor) -> None:
        """Copy the shard into ``dst`` (on the device), ordered before later work on the
        compute stream (the all-gather that reads it)."""

    def land(self, chunk: HostChunk, masters: torch.Tensor, slot: torch.Tensor) -> Event | None:
        """On the optimizer's worker: the chunk's updated masters become the shard's (cast);
        ``slot`` is a free host ring buffer (bytes) it may use. The event a gather must wait
        for, or None when the shard is updated on return."""

    def invalidate(self) -> None:
        """The shards are about to change (a step starts): forget anything read ahead."""

    def resident(self, *, write: bool) -> AbstractContextManager[None]:
        """Every shard a host tensor while inside; ``write``: changes are kept."""

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read from and written to its file since initialize (0 in host memory)."""

    @property
    def host_nbytes(self) -> int: ...

    @property
    def nvme_nbytes(self) -> int: ...

    def close(self) -> None: ...


class HostShards:
    """``offload.params="cpu"``: each shard is a host tensor (pinned on CUDA)."""

    tier = "cpu"
    aligned = False

    def __init__(self, streams: Streams, segments: list[ShardedSegment]) -> None:
        self.streams = streams
        self.segments = {seg.index: seg for seg in segments}
        for seg in segments:
            host = streams.host_empty(seg.shard.numel(), seg.dtype)
            host.copy_(seg.shard)
            seg.shard = host

    def holds(self, seg: int) -> bool:
        return seg in self.segments

    def stage(self, seg: ShardedSegment, dst: torch.Tensor) -> None:
        self.streams.compute.submit(partial(dst.copy_, seg.shard, non_blocking=True))

    def land(self, chunk: HostChunk, masters: torch.Tensor, slot: torch.Tensor) -> None:
        shard = self.segments[chunk.seg]
        chunk.of(shard.param_storage(shard.rank)).copy_(masters)
        return None

    def invalidate(self) -> None:
        pass

    def resident(self, *, write: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def io_bytes(self) -> tuple[int, int]:
        return 0, 0

    @property
    def host_nbytes(self) -> int:
        return sum(s.shard_nbytes for s in self.segments.values())

    @property
    def nvme_nbytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def make_home(
    plan: Plan, landing: Landing, segments: list[ShardedSegment], rank: int
) -> ShardHome | None:
    """The plan's home for the unit shards; None when they stay on the device."""
    if plan.offload_params == "none" or not segments:
        return None
    if plan.offload_params == "cpu":
        return HostShards(landing.streams, segments)
    assert plan.offload_path is not None
    slot_bytes = 4 * chunk_numel(plan.bucket_bytes)  # a chunk of fp32 ([Note: offload chunks])
    return DiskShards(landing, plan.offload_path, rank, segments, plan.offload_ring, slot_bytes)


@contextmanager
def resident(home: ShardHome | None, *, write: bool) -> Iterator[None]:
    """``home.resident`` where there is a home."""
    with home.resident(write=write) if home is not None else nullcontext():
        yield
