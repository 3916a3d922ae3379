"""Staging buffers for gradient reduction: a fixed pool, so their memory is set by the bucket
size and never by the model size (ZeRO-R's constant-size buffers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerodp.comm import Communicator, Handle
from zerodp.partition.segment import Segment


class StagingPool:
    """A fixed number of staging buffers, each the size of the largest bucket (plus, when
    ``with_scratch``, a 1/N scratch behind it)."""

    def __init__(
        self,
        bucket_numels: list[int],
        world: int,
        dtype: torch.dtype,
        device: torch.device,
        count: int,
        with_scratch: bool = True,
    ) -> None:
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        if not bucket_numels:
            return
        largest = max(bucket_numels)
        for _ in range(count):
            extra = largest // world if with_scratch else 0
            t = torch.empty(largest + extra, dtype=dtype, device=device)
            self._free.append(t)
            self._all.append(t)

    @property
    def available(self) -> bool:
        return bool(self._free)

    def acquire(self, numel: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging view of ``numel`` elements and its scratch (empty without scratch)."""
        t = self._free.pop()
        scratch = min(numel // world, t.numel() - numel)
        return t.narrow(0, 0, numel), t.narrow(0, numel, scratch)

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
    staging: torch.Tensor,
    target: torch.Tensor,
    *,
    accumulate: bool,
    convert: bool,
) -> tuple[Handle, Callable[[], None]]:
    """Start reducing ``staging`` across ranks into ``target`` (this rank's chunk, averaged).

    Returns the handle and the action to run once it completed. When accumulating onto an
    earlier round or converting dtype, the reduction lands in this rank's chunk of the staging
    buffer itself (no scratch) and is then added / cast into ``target``."""
    chunk = target.numel()
    own = staging.narrow(0, comm.rank * chunk, chunk)
    out = own if (accumulate or convert) else target
    handle = comm.reduce_scatter(out, staging, async_op=True)

    def average_into_target() -> None:
        out.div_(comm.world_size)
        if accumulate:
            target.add_(out)
        elif out is not target:
            target.copy_(out)

    return handle, average_into_target


def staging_pool(
    bucket_numels: list[int],
    world: int,
    segments: list[Segment],
    reduce_dtype: torch.dtype | None,
    count: int,
) -> StagingPool | None:
    """``count`` staging buffers for buckets of ``bucket_numels`` elements, in the reduce dtype
    (None: the gradients' own) on the segments' device; None when nothing is staged."""
    if not bucket_numels:
        return None
    first = segments[0]
    dtype = reduce_dtype or first.dtype
    return StagingPool(bucket_numels, world, dtype, first.device, count, with_scratch=False)
