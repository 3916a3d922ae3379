"""Flat and shard buffers answer the same questions in their own coordinates
([Note: flat and shard buffers])."""

from __future__ import annotations

import itertools

import pytest
import torch

from zerodp.optim.masters import copy_regions
from zerodp.partition import ParamSpec, build_layout
from zerodp.partition.buffers import FlatBuffer, ShardBuffer

SHAPES = [(7, 13), (13,), (0,), (1,), (5, 3), (2,), (64, 3)]


def _layout(world: int, bucket: int, align: int):
    return build_layout([ParamSpec(f"p{i}", s) for i, s in enumerate(SHAPES)], world, bucket, align)


@pytest.mark.parametrize(
    ("world", "bucket", "align"), list(itertools.product([1, 2, 3], [1, 24, 1000], [1, 4]))
)
def test_shard_buffer_holds_the_ranks_slices_of_the_flat_buffer(world, bucket, align):
    lay = _layout(world, bucket, align)
    flat = FlatBuffer(torch.arange(lay.padded_numel, dtype=torch.float64), lay, None)
    for rank in range(world):
        shard = ShardBuffer(torch.zeros(lay.shard_numel, dtype=torch.float64), lay, rank)
        copy_regions(shard, FlatBuffer(flat.data, lay, rank))
        assert torch.equal(shard.data, torch.cat(flat.owned(rank)))
        for pc in lay.pieces(rank):  # a piece is the same elements in both coordinates
            assert torch.equal(shard.piece(pc), flat.piece(pc))
            assert torch.equal(
                flat.piece(pc),
                flat.param(pc.slot).reshape(-1)[pc.param_range.start : pc.param_range.stop],
            )
        for b in lay.buckets:
            assert torch.equal(shard.region(b.index), flat.slice(b.index, rank))
            assert torch.equal(
                FlatBuffer(flat.data, lay, rank).region(b.index), shard.slice(b.index, rank)
            )
            assert torch.equal(flat.region(b.index), flat.bucket(b.index))  # owner None: all


def test_copy_regions_writes_only_the_owners_slices():
    lay = _layout(2, 24, 4)
    master = ShardBuffer(torch.full((lay.shard_numel,), 7.0), lay, 1)
    params = FlatBuffer(torch.zeros(lay.padded_numel, dtype=torch.bfloat16), lay, 1)
    copy_regions(params, master)
    owned = torch.zeros(lay.padded_numel, dtype=torch.bool)
    for b in lay.buckets:
        r = b.shard(1)
        owned[r.start : r.stop] = True
    assert torch.all(params.data[owned] == 7) and torch.all(params.data[~owned] == 0)


def test_a_shard_buffer_refuses_another_ranks_slice():
    lay = _layout(2, 24, 1)
    shard = ShardBuffer(torch.zeros(lay.shard_numel), lay, 0)
    with pytest.raises(AssertionError, match="rank 0's shard buffer holds no slice of rank 1"):
        shard.slice(0, 1)
