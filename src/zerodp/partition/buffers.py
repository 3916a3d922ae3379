"""Typed views of one segment's flat space: a full flat buffer, or one rank's shard buffer.

[Note: flat and shard buffers]
Gradients and masters live in one of two shapes (``layout.py`` for the geometry):

- a ``FlatBuffer`` holds the whole flat space (``padded_numel`` elements): the model's
  parameters, stage 0-1 gradients, stage 0 masters;
- a ``ShardBuffer`` holds one rank's slices of every bucket, concatenated in bucket order
  (``shard_numel`` elements): stage 2-3 gradients, stage 1-3 masters, stage 3 parameters.

Both answer the same questions, each in its own coordinates, so no caller carries a flag saying
which one it holds: ``piece`` (an optimizer piece's elements), ``slice`` (a rank's part of a
bucket) and ``region`` (what the buffer's *owner* steps of a bucket: its slice, or, for an
unsharded optimizer, the whole bucket).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zerodp.partition.layout import FlatLayout, Piece, Range


def flat_view(flat: torch.Tensor, r: Range) -> torch.Tensor:
    return flat.narrow(0, r.start, r.numel)


class OwnedStorage(Protocol):
    """A segment's gradients or masters as the optimizer and the checks read them."""

    data: torch.Tensor
    layout: FlatLayout

    @property
    def dense(self) -> bool:
        """The regions, in bucket order, are ``data`` itself (so two dense storages of one
        layout copy into each other in one go)."""
        ...

    def piece(self, piece: Piece) -> torch.Tensor: ...

    def slice(self, bucket: int, rank: int) -> torch.Tensor: ...

    def region(self, bucket: int) -> torch.Tensor: ...

    def owned(self, rank: int) -> list[torch.Tensor]:
        """``rank``'s slices of every bucket, as few tensors as the storage allows: over all
        ranks, every element once."""
        ...


class FlatBuffer:
    """The whole flat space of a segment. ``owner``: the rank whose optimizer steps it (its
    slices), or ``None`` when every rank steps every element (stage 0)."""

    __slots__ = ("data", "layout", "owner")

    def __init__(self, data: torch.Tensor, layout: FlatLayout, owner: int | None) -> None:
        assert data.numel() == layout.padded_numel, (data.numel(), layout.padded_numel)
        self.data = data
        self.layout = layout
        self.owner = owner

    @property
    def dense(self) -> bool:
        return self.owner is None

    def bucket(self, bucket: int) -> torch.Tensor:
        return flat_view(self.data, self.layout.buckets[bucket].flat)

    def slice(self, bucket: int, rank: int) -> torch.Tensor:
        return flat_view(self.data, self.layout.buckets[bucket].shard(rank))

    def region(self, bucket: int) -> torch.Tensor:
        return flat_view(self.data, self.layout.buckets[bucket].region(self.owner))

    def piece(self, piece: Piece) -> torch.Tensor:
        return flat_view(self.data, piece.flat_range)

    def param(self, slot: int) -> torch.Tensor:
        s = self.layout.slots[slot]
        return flat_view(self.data, s.flat).view(s.spec.shape)

    def owned(self, rank: int) -> list[torch.Tensor]:
        return [self.slice(b.index, rank) for b in self.layout.buckets]


class ShardBuffer:
    """One rank's slices of every bucket of a segment, in bucket order."""

    __slots__ = ("data", "layout", "rank")

    def __init__(self, data: torch.Tensor, layout: FlatLayout, rank: int) -> None:
        assert data.numel() == layout.shard_numel, (data.numel(), layout.shard_numel)
        self.data = data
        self.layout = layout
        self.rank = rank

    @property
    def dense(self) -> bool:
        return True

    def slice(self, bucket: int, rank: int) -> torch.Tensor:
        assert rank == self.rank, f"rank {self.rank}'s shard buffer holds no slice of rank {rank}"
        b = self.layout.buckets[bucket]
        return self.data.narrow(0, b.shard_offset, b.shard_numel)

    def region(self, bucket: int) -> torch.Tensor:
        return self.slice(bucket, self.rank)

    def piece(self, piece: Piece) -> torch.Tensor:
        return self.data.narrow(0, piece.shard_offset, piece.flat_range.numel)

    def owned(self, rank: int) -> list[torch.Tensor]:
        assert rank == self.rank, f"rank {self.rank}'s shard buffer holds no slice of rank {rank}"
        return [self.data]
