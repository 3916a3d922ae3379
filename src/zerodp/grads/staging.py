"""Staging buffers for gradient reduction: a fixed pool, so their memory is set by the bucket
size and never by the model size (ZeRO-R's constant-size buffers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from zerodp.comm import Communicator, Handle
from zerodp.partition.segment import Segment


class Staged(NamedTuple):
    """A staging view and the buffer its reduce-scatter receives into (None: none needed,
    [Note: point-to-point reduce-scatter] in comm/gloo_cpu.py)."""

    data: torch.Tensor
    received: torch.Tensor | None


class StagingPool:
    """A fixed number of staging buffers, each the size of the largest bucket plus what its
    reduce-scatter receives into (``receive_numel(numel)`` elements behind it; 0 on NCCL)."""

    def __init__(
        self,
        bucket_numels: list[int],
        dtype: torch.dtype,
        device: torch.device,
        count: int,
        receive_numel: Callable[[int], int] | None = None,
    ) -> None:
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._receive_numel = receive_numel or (lambda numel: 0)
        if not bucket_numels:
            return
        largest = max(bucket_numels)
        extra = self._receive_numel(largest)
        for _ in range(count):
            t = torch.empty(largest + extra, dtype=dtype, device=device)
            self._free.append(t)
            self._all.append(t)

    @property
    def available(self) -> bool:
        return bool(self._free)

    def acquire(self, numel: int) -> Staged:
        """A staging view of ``numel`` elements and its receive buffer."""
        t = self._free.pop()
        extra = self._receive_numel(numel)
        return Staged(t.narrow(0, 0, numel), t.narrow(0, numel, extra) if extra else None)

    def release(self, staging: torch.Tensor) -> None:
        for t in self._all:
            if t.data_ptr() == staging.data_ptr():
                self._free.append(t)
                return
        raise AssertionError("released a staging buffer the pool does not own")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._all)


def zeros_like_shard(seg: Segment) -> torch.Tensor:
    return torch.zeros(seg.layout.shard_numel, dtype=seg.dtype, device=seg.device)


def zero_range(t: torch.Tensor, start: int, stop: int) -> None:
    if stop > start:
        t[start:stop].zero_()


def reduce_scatter_into(
    comm: Communicator,
    staged: Staged,
    target: torch.Tensor,
    *,
    accumulate: bool,
    convert: bool,
) -> tuple[Handle, Callable[[], None]]:
    """Start reducing the staging buffer across ranks into ``target`` (this rank's chunk,
    averaged).

    Returns the handle and the action to run once it completed. When accumulating onto an
    earlier round or converting dtype, the reduction lands in this rank's chunk of the staging
    buffer itself (no scratch) and is then added / cast into ``target``."""
    staging = staged.data
    chunk = target.numel()
    own = staging.narrow(0, comm.rank * chunk, chunk)
    out = own if (accumulate or convert) else target
    handle = comm.reduce_scatter(out, staging, received=staged.received, async_op=True)

    def average_into_target() -> None:
        average(out, target, accumulate=accumulate, world=comm.world_size)

    return handle, average_into_target


def average(out: torch.Tensor, target: torch.Tensor, *, accumulate: bool, world: int) -> None:
    """``out``, a sum over ``world`` ranks, averaged into ``target`` (which it may be): added to
    it when accumulating, else written. ``out`` is scratch afterwards."""
    if accumulate:
        out.div_(world)
        target.add_(out)
    elif out.data_ptr() == target.data_ptr():
        out.div_(world)
    elif out.dtype == target.dtype:
        torch.div(out, world, out=target)  # one pass: the quotient straight into place
    else:
        out.div_(world)
        target.copy_(out)


def staging_pool(
    bucket_numels: list[int],
    comm: Communicator,
    segments: list[Segment],
    reduce_dtype: torch.dtype | None,
    count: int,
    scatter: bool = True,
) -> StagingPool | None:
    """``count`` staging buffers for buckets of ``bucket_numels`` elements, in the reduce dtype
    (None: the gradients' own) on the segments' device, with room for what a reduce-scatter
    receives (``scatter``; all-reduces need none); None when nothing is staged."""
    if not bucket_numels:
        return None
    first = segments[0]
    dtype = reduce_dtype or first.dtype
    device = first.device

    def receive_numel(numel: int) -> int:
        return comm.receive_numel(numel, device)

    return StagingPool(bucket_numels, dtype, device, count, receive_numel if scatter else None)
