"""Master parameters: what the optimizer updates, and how updates reach the model.

[Note: mixed precision]
fp32 training: the optimizer's pieces are views of the model's own flat parameter buffer, so a
step updates the model in place (then stages 1-2 all-gather the owned slices).

bf16/fp16 training (``ZeroConfig.precision``): the model's parameters and gradients are in the
compute dtype; an fp32 master copy exists only for the owned pieces (stages 1-2: a shard buffer
of ``shard_numel``; stage 0: the whole flat space), initialised from the fp32 parameters before
they are cast. At each step the optimizer steps the fp32 masters on the owned gradient upcast
(averaged, unscaled) one bucket at a time into a constant-size fp32 scratch ([Note: chunked
fp32 gradients] in optim/chunked.py), and ``publish`` casts the updated masters into the
compute-dtype buffer before the all-gather. At rest a rank holds exactly the paper's model states
(2Ψ params + 2Ψ or 2Ψ/N grads + 12Ψ or 12Ψ/N for masters, momentum, variance) plus that
scratch (one bucket's owned slice in fp32, set by ``bucket_bytes``, not by the model); no
step allocates an fp32 copy of the owned gradient.

Stage 3 (``ShardedSegment``, [Note: sharded storage]): the owned shard is all a rank holds at
rest. fp32: the masters *are* the shards. Mixed: the masters are fp32 copies of the shards, and
``publish`` casts them into the shards; units are gathered when next used, not here.

Optimizer offload (``ZeroConfig.offload.optimizer``, stages 1-3): the masters are fp32 copies
of the owned slices in host memory at every precision, and the offloaded step copies each
bucket's update back ([Note: offloaded step] in offload/runner.py); ``publish`` is the
synchronous copy a checkpoint load uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch

from zerodp.partition.buffers import FlatBuffer, OwnedStorage, ShardBuffer
from zerodp.partition.segment import Segment


class ReducedGrads(Protocol):
    """What the masters need of a reducer (``GradReducer``, or ``ShardedGrads`` in stage 3)."""

    def grad_storage(self, seg: int) -> OwnedStorage: ...


class Resident(Protocol):
    """Where the masters rest between steps when not in memory (``SwapStore``, NVMe)."""

    def resident(self, *, write: bool) -> AbstractContextManager[None]: ...

    def wait(self) -> None: ...

    def io_bytes(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


class Masters:
    """Master storage for every segment; see [Note: mixed precision]."""

    def __init__(
        self,
        segments: list[Segment],
        *,
        separate: bool,
        sharded: bool,
        rank: int,
        host: bool = False,
        stored: bool = False,
        kept: frozenset[int] = frozenset(),
    ):
        self.segments = segments
        self.host = host  # in host memory (optimizer offload; sharded only)
        # Partial offload ([Note: partial offload] in offload/partial.py): these segments'
        # masters stay on the device, as without offload.
        self.kept = kept
        self.mixed = separate  # fp32 copies wherever they are (else: the params, on the device)
        self.owner = rank if sharded else None  # whose slices the optimizer steps
        self.rank = rank
        # NVMe: the store writes these initial values to its files and drops them at once.
        self.stored = stored
        assert not host or sharded, "offloaded masters are the owned slices (stages 1-3)"
        self.buffers: list[OwnedStorage | None] = [self._master(seg) for seg in segments]
        self.store: Resident | None = None  # NVMe: the masters are in files between steps

    def on_host(self, i: int) -> bool:
        """Segment ``i``'s masters are in host memory (or on NVMe)."""
        return self.host and i not in self.kept

    def is_separate(self, i: int) -> bool:
        """Segment ``i``'s masters are fp32 copies, not the parameters themselves."""
        return self.mixed or self.on_host(i)

    @property
    def separate(self) -> bool:
        """Some segment's masters are copies (every one's, without partial offload)."""
        return self.mixed or (self.host and len(self.kept) < len(self.segments))

    def _master(self, seg: Segment) -> OwnedStorage:
        params = seg.param_storage(self.owner)
        if not self.is_separate(seg.index):
            return params
        if self.owner is None:
            return FlatBuffer(params.data.detach().float().clone(), seg.layout, None)
        on_host = self.on_host(seg.index)
        if self.stored and on_host and _host_fp32_shard(params):
            # Only read once, before any step, into the store's files: no copy (at fp32 the
            # shard holds exactly the masters' values), so initialize needs no second 4 B/param.
            return params
        device = torch.device("cpu") if on_host else seg.device
        data = torch.empty(seg.layout.shard_numel, dtype=torch.float32, device=device)
        master = ShardBuffer(data, seg.layout, self.rank)
        copy_regions(master, params)
        return master

    def add(self, segments: list[Segment]) -> None:
        """Masters for segments appended to the engine's list (unfrozen parameters)."""
        self.buffers += [self._master(seg) for seg in segments]

    def storage(self, i: int) -> OwnedStorage:
        buffer = self.buffers[i]
        if buffer is None:
            raise RuntimeError(
                "zerodp: the fp32 masters are on NVMe between steps "
                "(ZeroConfig.offload.optimizer='nvme'): read or write them inside "
                "Masters.resident()"
            )
        return buffer

    # -- on NVMe ([Note: optimizer state on NVMe] in offload/swap.py) --------------------------

    def evict(self) -> None:
        """Drop the host copies: the store holds the values (the kept ones stay)."""
        self.buffers = [None if self.on_host(i) else b for i, b in enumerate(self.buffers)]

    def restore(self) -> None:
        """Empty host shard buffers again, for the store to fill."""
        self.buffers = [
            ShardBuffer(torch.empty(seg.layout.shard_numel), seg.layout, self.rank)
            if self.on_host(seg.index)
            else b
            for seg, b in zip(self.segments, self.buffers, strict=True)
        ]

    @contextmanager
    def resident(self, *, write: bool) -> Iterator[None]:
        """The masters and the optimizer state in memory while inside (a no-op unless they
        rest on NVMe); ``write``: what was changed inside is kept."""
        with self.store.resident(write=write) if self.store is not None else nullcontext():
            yield

    def settle(self) -> None:
        """Wait until the store holds the last step's values (raises what failed)."""
        if self.store is not None:
            self.store.wait()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, only: frozenset[int] | None = None) -> None:
        """Refresh the owned slices of the model's parameters from the masters (a cast, under
        mixed precision; nothing where the masters are the parameters), of every segment or
        those in ``only``. The other slices arrive by all-gather ([Note: deferred parameter
        gather] in params/deferred.py)."""
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                if self.is_separate(i) and (only is None or i in only):
                    copy_regions(seg.param_storage(self.owner), self.storage(i))

    def nbytes_where(self, *, host: bool) -> int:
        """Bytes of fp32 master copies in host memory (``host``) or on the device (0 where the
        masters are the parameters themselves)."""
        held = [
            b
            for i, b in enumerate(self.buffers)
            if b is not None and self.is_separate(i) and self.on_host(i) == host
        ]
        return sum(b.data.numel() * b.data.element_size() for b in held)

    @property
    def nbytes(self) -> int:
        """Bytes of fp32 master copies, wherever they are."""
        return self.nbytes_where(host=True) + self.nbytes_where(host=False)


def copy_regions(dst: OwnedStorage, src: OwnedStorage) -> None:
    """What the owner steps of every bucket, from ``src`` into ``dst`` (casting)."""
    if dst.dense and src.dense and dst.data.numel() == src.data.numel():
        dst.data.copy_(src.data)  # the same coordinates: one copy
        return
    for b in dst.layout.buckets:
        dst.region(b.index).copy_(src.region(b.index))


def _host_fp32_shard(params: OwnedStorage) -> bool:
    data = params.data
    return (
        isinstance(params, ShardBuffer)
        and data.device.type == "cpu"
        and data.dtype == torch.float32
    )
