"""Pure layout math: every element owned exactly once, balanced shards, aligned pieces."""

from __future__ import annotations

import itertools

import pytest

from zerodp.partition import ParamSpec, Range, build_layout

SHAPES = [(7, 13), (13,), (0,), (1,), (5, 3), (2,), (64, 3)]


def _specs(shapes=SHAPES):
    return [ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)]


@pytest.mark.parametrize(
    ("world", "bucket", "align"), list(itertools.product([1, 2, 3, 4], [1, 8, 24, 1000], [1, 4]))
)
def test_pieces_partition_every_parameter(world, bucket, align):
    lay = build_layout(_specs(), world, bucket, align)
    assert lay.padded_numel % (world * align) == 0
    assert all(b.numel % (world * align) == 0 for b in lay.buckets)
    assert [b.flat.start for b in lay.buckets[1:]] == [b.flat.stop for b in lay.buckets[:-1]]
    for b in lay.buckets:  # the geometry each bucket carries
        assert b.slots == tuple(s.index for s in lay.slots if s.flat.intersect(b.flat))
        assert [b.shard(r) for r in range(world)] == [
            Range(b.flat.start + r * b.shard_numel, b.flat.start + (r + 1) * b.shard_numel)
            for r in range(world)
        ]
        assert b.shard_offset * world == b.flat.start
        assert b.region(None) == b.flat and b.region(world - 1) == b.shard(world - 1)
    covered: dict[int, list[Range]] = {}
    for rank in range(world):
        pieces = lay.pieces(rank)
        assert sum(p.flat_range.numel for p in pieces) <= lay.shard_numel
        for p in pieces:
            slot = lay.slots[p.slot]
            assert p.flat_range.shift(-slot.flat.start) == p.param_range
            bucket = lay.buckets[p.bucket]
            owned = bucket.shard(rank)
            assert owned.start <= p.flat_range.start and p.flat_range.stop <= owned.stop
            assert p.shard_offset == bucket.shard_offset + (p.flat_range.start - owned.start)
            covered.setdefault(p.slot, []).append(p.param_range)
    for slot in lay.slots:
        ranges = sorted(covered.get(slot.index, []))
        total = sum(r.numel for r in ranges)
        assert total == slot.spec.numel, (slot.spec, ranges)
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
        assert slot.flat.start % align == 0


def test_full_pieces_cover_each_parameter_once():
    lay = build_layout(_specs(), 3, 24, 4)
    per_slot: dict[int, int] = {}
    for p in lay.full_pieces():
        per_slot[p.slot] = per_slot.get(p.slot, 0) + p.param_range.numel
    assert per_slot == {s.index: s.spec.numel for s in lay.slots if s.spec.numel}


def test_one_bucket_is_one_contiguous_range_per_rank():
    # With the bucket at least the segment, rank r owns the r-th contiguous 1/N of it.
    lay = build_layout(_specs(), 4, 10**9, 1)
    assert len(lay.buckets) == 1
    assert [lay.buckets[0].shard(r) for r in range(4)] == [
        Range(r * lay.shard_numel, (r + 1) * lay.shard_numel) for r in range(4)
    ]


def test_zero_size_parameter_has_no_bucket():
    lay = build_layout([ParamSpec("e", (0,))], 2, 8, 1)
    assert lay.padded_numel == 0 and lay.buckets == () and lay.slot_buckets == ((),)


def test_range_intersection():
    assert Range(0, 5).intersect(Range(3, 9)) == Range(3, 5)
    assert Range(0, 3).intersect(Range(3, 9)) is None
