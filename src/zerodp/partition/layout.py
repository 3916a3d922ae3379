"""Pure layout math: where every parameter lives in a flat buffer and which rank owns what.

[Note: flat buffers]
Trainable parameters of one dtype (one *segment*; in stage 3 one segment per unit) are laid out
one after the other in a single flat 1-D space, each starting at an offset aligned to
``align`` elements. The space is cut into *buckets*: consecutive ranges whose length is a
multiple of ``world_size * align`` (so a bucket may cut through a parameter; only the end of the
segment is padded). Each rank owns the r-th contiguous 1/N slice of **every bucket**.

Why per bucket rather than one contiguous 1/N of the whole segment: a bucket's gradients become
ready together during backward, so a bucket is reduce-scattered as soon as it is complete with a
plain equal-chunk collective, and all-gathered the same way. With one contiguous range per rank
a bucket would hold a piece of every rank's range, i.e. gradients from the first and last layers,
and could only be reduced at the end of backward. With ``bucket_bytes`` at least the segment size
the two layouts coincide. (Megatron's distributed optimizer and FSDP units do the same.)

A *piece* is the intersection of one parameter with one rank's slice of one bucket: a contiguous
range of that parameter's flattened elements. Optimizer state is kept per piece, and checkpoints
are keyed by (parameter name, range), so resharding is range intersection. Nothing here touches
tensors: the runtime (``flat_buffer``) and offline tools share this one definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True, slots=True, order=True)
class Range:
    """A half-open integer range ``[start, stop)``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.stop, self

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def intersect(self, other: Range) -> Range | None:
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Range(start, stop) if start < stop else None

    def shift(self, delta: int) -> Range:
        return Range(self.start + delta, self.stop + delta)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Slot:
    """A parameter's place in the flat space."""

    index: int  # position in FlatLayout.params
    spec: ParamSpec
    flat: Range  # elements of the flat space holding this parameter, in order


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one parameter owned by one rank inside one bucket."""

    slot: int  # FlatLayout.slots index
    bucket: int
    param_range: Range  # range of the parameter's flattened elements
    flat_range: Range  # the same elements in the flat space
    shard_offset: int  # where they start in the owning rank's shard buffer


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket of a segment: the unit of communication. Its geometry is computed once, by
    ``build_layout``; every user (both gradient syncs, the parameter gather, the optimizer's
    chunks, the masters, checkpoints) reads it from here."""

    index: int  # position in FlatLayout.buckets
    flat: Range  # the bucket in the flat space; a multiple of world_size * align elements
    world_size: int
    slots: tuple[int, ...]  # the parameters (FlatLayout.slots indices) overlapping it

    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns of this bucket."""
        return self.flat.numel // self.world_size

    @property
    def shard_offset(self) -> int:
        """Where a rank's slice of this bucket starts in its shard buffer (the concatenation of
        that rank's slices of all buckets, in bucket order)."""
        return self.flat.start // self.world_size

    def shard(self, rank: int) -> Range:
        """The flat-space slice of this bucket owned by ``rank``."""
        start = self.flat.start + rank * self.shard_numel
        return Range(start, start + self.shard_numel)

    def region(self, owner: int | None) -> Range:
        """What ``owner`` steps of this bucket: its slice, or (``None``: an unsharded
        optimizer, stage 0) all of it."""
        return self.flat if owner is None else self.shard(owner)


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of one segment for one world size. Immutable; shared by all ranks."""

    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]  # contiguous, cover [0, padded_numel)
    world_size: int
    align: int

    @property
    def padded_numel(self) -> int:
        return self.buckets[-1].flat.stop if self.buckets else 0

    @property
    def param_numel(self) -> int:
        return sum(s.spec.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns (the same for every rank)."""
        return self.padded_numel // self.world_size

    @cached_property
    def slot_buckets(self) -> tuple[tuple[int, ...], ...]:
        """For each slot, the buckets it overlaps (empty for a zero-size parameter)."""
        out: list[list[int]] = [[] for _ in self.slots]
        for bucket in self.buckets:
            for s in bucket.slots:
                out[s].append(bucket.index)
        return tuple(tuple(x) for x in out)

    def pieces(self, rank: int) -> list[Piece]:
        """Every piece owned by ``rank``, in flat order."""
        out: list[Piece] = []
        for bucket in self.buckets:
            owned = bucket.shard(rank)
            base = bucket.shard_offset - owned.start
            for s in bucket.slots:
                out.extend(self._piece(s, bucket.index, owned, base))
        return out

    def full_pieces(self) -> list[Piece]:
        """Pieces covering every parameter entirely (one per overlapped bucket): what an
        unsharded optimizer (stage 0) steps on. ``shard_offset`` is the flat offset."""
        out: list[Piece] = []
        for bucket in self.buckets:
            for s in bucket.slots:
                out.extend(self._piece(s, bucket.index, bucket.flat, 0))
        return out

    def owned_pieces(self, owner: int | None) -> list[Piece]:
        """What ``owner`` steps: its pieces, or (``None``, stage 0) every parameter whole."""
        return self.full_pieces() if owner is None else self.pieces(owner)

    def _piece(self, s: int, bucket: int, owned: Range, base: int) -> list[Piece]:
        slot = self.slots[s]
        inter = slot.flat.intersect(owned)
        if inter is None:
            return []
        param_range = inter.shift(-slot.flat.start)
        return [Piece(s, bucket, param_range, inter, inter.start + base)]


def build_layout(
    specs: Sequence[ParamSpec], world_size: int, bucket_numel: int, align: int = 1
) -> FlatLayout:
    """Place ``specs`` in order, aligned to ``align`` elements, and cut buckets of about
    ``bucket_numel`` elements (rounded to a multiple of ``world_size * align``)."""
    if world_size < 1 or align < 1 or bucket_numel < 1:
        raise ValueError("world_size, align and bucket_numel must be positive")
    slots: list[Slot] = []
    offset = 0
    for i, spec in enumerate(specs):
        offset = _round_up(offset, align)
        slots.append(Slot(i, spec, Range(offset, offset + spec.numel)))
        offset += spec.numel
    quantum = world_size * align
    padded = _round_up(offset, quantum)
    step = max(quantum, (bucket_numel // quantum) * quantum)
    ranges = [Range(s, min(s + step, padded)) for s in range(0, padded, step)]
    buckets = tuple(
        Bucket(b, r, world_size, tuple(s.index for s in slots if s.flat.intersect(r)))
        for b, r in enumerate(ranges)
    )
    return FlatLayout(tuple(slots), buckets, world_size, align)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
