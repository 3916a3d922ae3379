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


@dataclass(frozen=True)
class FlatLayout:
    """The flat layout of one segment for one world size. Immutable; shared by all ranks."""

    slots: tuple[Slot, ...]
    buckets: tuple[Range, ...]  # contiguous, cover [0, padded_numel), each a multiple of N*align
    world_size: int
    align: int

    @property
    def padded_numel(self) -> int:
        return self.buckets[-1].stop if self.buckets else 0

    @property
    def param_numel(self) -> int:
        return sum(s.spec.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns (the same for every rank)."""
        return self.padded_numel // self.world_size

    def bucket_shard(self, bucket: int, rank: int) -> Range:
        """The flat-space slice of ``bucket`` owned by ``rank``."""
        b = self.buckets[bucket]
        size = b.numel // self.world_size
        return Range(b.start + rank * size, b.start + (rank + 1) * size)

    def bucket_shard_offset(self, bucket: int) -> int:
        """Where ``bucket``'s owned slice starts in a rank's shard buffer (the concatenation of
        that rank's slices of all buckets, in bucket order)."""
        return self.buckets[bucket].start // self.world_size

    @cached_property
    def bucket_slots(self) -> tuple[tuple[int, ...], ...]:
        """For each bucket, the slots (parameters) that overlap it."""
        out: list[list[int]] = [[] for _ in self.buckets]
        for slot in self.slots:
            if slot.flat.numel:
                for b in self._buckets_overlapping(slot.flat):
                    out[b].append(slot.index)
        return tuple(tuple(x) for x in out)

    @cached_property
    def slot_buckets(self) -> tuple[tuple[int, ...], ...]:
        """For each slot, the buckets it overlaps (empty for a zero-size parameter)."""
        return tuple(
            tuple(self._buckets_overlapping(s.flat)) if s.flat.numel else () for s in self.slots
        )

    def pieces(self, rank: int) -> list[Piece]:
        """Every piece owned by ``rank``, in flat order."""
        out: list[Piece] = []
        for b in range(len(self.buckets)):
            owned = self.bucket_shard(b, rank)
            base = self.bucket_shard_offset(b) - owned.start
            for s in self.bucket_slots[b]:
                out.extend(self._piece(s, b, owned, base))
        return out

    def full_pieces(self) -> list[Piece]:
        """Pieces covering every parameter entirely (one per overlapped bucket): what an
        unsharded optimizer (stage 0) steps on. ``shard_offset`` is the flat offset."""
        out: list[Piece] = []
        for b, bucket in enumerate(self.buckets):
            for s in self.bucket_slots[b]:
                out.extend(self._piece(s, b, bucket, 0))
        return out

    def _piece(self, s: int, bucket: int, owned: Range, base: int) -> list[Piece]:
        slot = self.slots[s]
        inter = slot.flat.intersect(owned)
        if inter is None:
            return []
        param_range = inter.shift(-slot.flat.start)
        return [Piece(s, bucket, param_range, inter, inter.start + base)]

    def _buckets_overlapping(self, r: Range) -> range:
        first = _bucket_index(self.buckets, r.start)
        last = _bucket_index(self.buckets, r.stop - 1)
        return range(first, last + 1)


def _bucket_index(buckets: Sequence[Range], pos: int) -> int:
    lo, hi = 0, len(buckets) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if buckets[mid].stop <= pos:
            lo = mid + 1
        else:
            hi = mid
    return lo


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
    buckets = tuple(Range(s, min(s + step, padded)) for s in range(0, padded, step))
    return FlatLayout(tuple(slots), buckets, world_size, align)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
