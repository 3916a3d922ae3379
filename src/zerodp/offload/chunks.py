"""The offloaded step's unit of work, a *chunk*: at most ``chunk_numel`` owned elements of one
bucket, so that every host ring is a few chunks whatever the size of a bucket or parameter.

[Note: offload chunks]
Stage 3 gathers a whole unit with one collective, so a unit segment is one bucket and this
rank's region of it is the whole unit shard: the embedding of a 350M GPT alone is 33M
elements. Were the chunk a bucket's region, each ring slot (gradients in, parameters out, the
NVMe tier's masters and state) would be that large. So the regions are cut every
``chunk_numel`` elements (``bucket_bytes`` of fp32, rounded up to a whole number of 4 KiB
blocks of any dtype, which keeps every chunk's place in a file aligned for O_DIRECT), and the
optimizer's pieces are cut at the same places (``split_pieces``): zerodp's optimizers are
element-wise (optim/pieces.py), so stepping a parameter in two pieces computes exactly what
stepping it whole does. Checkpoints address optimizer state by parameter element ranges, so
they do not see the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zerodp.offload.swapfile import ALIGN
from zerodp.optim.chunked import pieces_by_chunk
from zerodp.optim.pieces import OptimPiece
from zerodp.partition.buffers import OwnedStorage
from zerodp.partition.layout import FlatLayout, Piece, Range
from zerodp.partition.segment import Segment


@dataclass(frozen=True, slots=True)
class HostChunk:
    seg: int
    bucket: int
    start: int  # where it starts in the bucket's owned region
    numel: int
    offset: int  # where it starts in the host gradient
    pieces: tuple[tuple[int, int, int], ...]  # (index in pieces, offset in chunk, numel)

    def of(self, storage: OwnedStorage) -> torch.Tensor:
        """This chunk's elements of an owned storage (gradients, masters, parameters)."""
        return storage.region(self.bucket).narrow(0, self.start, self.numel)


def chunk_numel(bucket_bytes: int) -> int:
    """Elements per chunk: ``bucket_bytes`` of fp32, a whole number of ALIGN-byte blocks in
    any dtype (a multiple of ALIGN elements)."""
    blocks = max(1, -(-(bucket_bytes // 4) // ALIGN))
    return blocks * ALIGN


def split_pieces(pieces: list[Piece], layout: FlatLayout, owner: int, numel: int) -> list[Piece]:
    """``pieces`` cut where the owned region of their bucket crosses a multiple of ``numel``."""
    out: list[Piece] = []
    for pc in pieces:
        base = layout.buckets[pc.bucket].region(owner).start
        start = pc.flat_range.start
        while start < pc.flat_range.stop:
            stop = min(pc.flat_range.stop, base + ((start - base) // numel + 1) * numel)
            skip = start - pc.flat_range.start
            flat = Range(start, stop)
            params = Range(pc.param_range.start + skip, pc.param_range.start + skip + flat.numel)
            out.append(Piece(pc.slot, pc.bucket, params, flat, pc.shard_offset + skip))
            start = stop
    return out


def host_chunks(
    segments: list[Segment],
    pieces: list[OptimPiece],
    owner: int,
    order: Sequence[tuple[int, int]],
    numel: int,
) -> list[HostChunk]:
    """The chunks of the buckets in ``order`` that hold pieces, each bucket's in place order,
    with their places in one host gradient laid out in that order."""
    by_bucket = pieces_by_chunk(segments, pieces, owner)
    out: list[HostChunk] = []
    offset = 0
    for s, b in order:
        entries = by_bucket.get((s, b))
        if not entries:  # nothing the optimizer steps: never updated, never copied
            continue
        region = segments[s].layout.buckets[b].region(owner).numel
        for start in range(0, region, numel):
            size = min(numel, region - start)
            mine = tuple(
                (k, off - start, n) for k, off, n in entries if start <= off < start + size
            )
            if mine:
                out.append(HostChunk(s, b, start, size, offset, mine))
                offset += size
    return out
