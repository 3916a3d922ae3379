"""Reduce-scatter and all-gather of CPU tensors over gloo, built from other collectives.

[Note: gloo chunked collectives]
gloo's reduce_scatter_single / all_gather_single copy the whole bucket and allocate
bucket-sized temporaries on the calling thread (measured 36-40 ms and 15-23 ms for a 25 MiB
bucket on 2 ranks, against 30 and 10-13 ms for one in-place reduce / broadcast per owner chunk,
which move the same data). On gloo with CPU tensors the communicator therefore runs them chunk
by chunk, and a reduce-scatter given a receive buffer point to point ([Note: point-to-point
reduce-scatter]); its ledger records the logical collective. A reduce-scatter whose input
lies in pieces (gradients) sends them as they lie ([Note: reduce-scatter from pieces]).

[Note: point-to-point reduce-scatter]
gloo's reduce moves more than the chunk it reduces: measured on 2 ranks for 12 MiB, 7.5 ms of
wall time and 5.4 ms of CPU over all threads per reduce-scatter of one reduce per chunk, against
3.6 ms and 2.4 ms here. Here every rank sends each other rank its chunk and receives theirs of
its own into ``received`` ((N-1)/N of the input: the staging pools keep it behind each staging
buffer, counted in ``comm_buffers``); the rank that waits adds them to its own chunk, the others
in rank order (for 3 ranks or more not gloo's order: the sums agree to rounding). The tag
numbers the calls, so two in flight between the same ranks never take each other's data. Every
rank must take the same path for the same call: each caller passes a receive buffer on every
rank or on none.

Each function returns what the communicator runs through its watchdog: ``launch`` (starts the
works and returns them) and ``after`` (what runs on the waiting thread once they completed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

Launch = Callable[[], list[Any]]
After = Callable[[], None]

TAGS = 1 << 12
"""Tags of point-to-point reduce-scatters cycle through this many values: far more than can be
in flight at once (the staging pools hold a few buffers)."""


def gloo_on_cpu(backend: str) -> bool:
    return backend == "gloo" or "cpu:gloo" in backend


def receives_point_to_point(backend: str, device: torch.device) -> bool:
    """Whether a reduce-scatter of ``device`` tensors over ``backend`` runs point to point, into
    a receive buffer of (N-1)/N of its input ([Note: point-to-point reduce-scatter]): gloo on
    CPU."""
    return gloo_on_cpu(backend) and device.type == "cpu"


def copy_unless_alias(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def reduce_per_chunk(
    group: Any, rank: int, output: torch.Tensor, chunks: tuple[torch.Tensor, ...]
) -> tuple[Launch, After | None]:
    """One in-place reduce per owner chunk; the input's other chunks become scratch."""
    own = chunks[rank]

    def launch() -> list[Any]:
        return [
            dist.reduce(c, group=group, group_dst=r, async_op=True) for r, c in enumerate(chunks)
        ]

    if own.data_ptr() == output.data_ptr():
        return launch, None

    def into_output() -> None:
        output.copy_(own)

    return launch, into_output


def reduce_point_to_point(
    group: Any,
    rank: int,
    output: torch.Tensor,
    chunks: tuple[torch.Tensor, ...],
    received: torch.Tensor,
    tag: int,
) -> tuple[Launch, After]:
    """[Note: point-to-point reduce-scatter]"""
    n = len(chunks)
    own = chunks[rank]
    numel = own.numel()
    peers = [r for r in range(n) if r != rank]
    parts = received[: numel * (n - 1)].view(n - 1, numel)

    def launch() -> list[Any]:
        works = [
            dist.irecv(parts[k], group=group, group_src=r, tag=tag) for k, r in enumerate(peers)
        ]
        works += [dist.isend(chunks[r], group=group, group_dst=r, tag=tag) for r in peers]
        return works

    def add() -> None:
        for part in parts:
            own.add_(part)
        copy_unless_alias(output, own)

    return launch, add


class Piece(NamedTuple):
    """``numel`` elements at ``offset`` in one rank's chunk of a reduce-scatter's input:
    ``tensor`` (1-D, contiguous), or zeros where it is None ([Note: reduce-scatter from
    pieces])."""

    offset: int
    numel: int
    tensor: torch.Tensor | None


def gaps(pieces: Sequence[Piece], numel: int) -> list[tuple[int, int]]:
    """The (start, stop) of a ``numel``-element chunk that no piece covers (pieces in order)."""
    out, cursor = [], 0
    for p in pieces:
        if p.offset > cursor:
            out.append((cursor, p.offset))
        cursor = p.offset + p.numel
    if numel > cursor:
        out.append((cursor, numel))
    return out


def reduce_pieces_point_to_point(
    group: Any,
    rank: int,
    chunks: Sequence[Sequence[Piece]],
    numel: int,
    received: torch.Tensor,
    tag: int,
) -> tuple[Launch, After, torch.Tensor]:
    """[Note: reduce-scatter from pieces]
    The point-to-point reduce-scatter ([Note: point-to-point reduce-scatter]) of an input that
    is never put together: rank r's chunk is ``chunks[r]``, pieces at the same offsets on every
    rank (the layout decides them, not the data), so each piece travels as its own message,
    straight from the tensor that holds it (a parameter's gradient) instead of from a staging
    copy. Elements no piece covers are zeros on every rank (padding) and are not sent. Returns
    the launch, the action that sums this rank's chunk once the messages arrived, and where the
    sum lands: the first ``numel`` elements of ``received``. The additions are those of the
    staged path, in its order (the own chunk plus each other rank's in rank order; addition
    commutes exactly), so the sums agree bit for bit."""
    n = len(chunks)
    peers = [r for r in range(n) if r != rank]
    parts = received[: numel * (n - 1)].view(n - 1, numel)
    mine = chunks[rank]
    total = parts[0]

    def payload(piece: Piece) -> torch.Tensor:
        if piece.tensor is not None:
            return piece.tensor
        return received.new_zeros(piece.numel)

    def launch() -> list[Any]:
        works = [
            dist.irecv(parts[k].narrow(0, p.offset, p.numel), group=group, group_src=r, tag=tag)
            for k, r in enumerate(peers)
            for p in mine
        ]
        works += [
            dist.isend(payload(p), group=group, group_dst=r, tag=tag)
            for r in peers
            for p in chunks[r]
        ]
        return works

    def add() -> None:
        for p in mine:
            # No tensor: the staged path adds its zeros, which turns a sum of -0.0 into +0.0.
            total.narrow(0, p.offset, p.numel).add_(0.0 if p.tensor is None else p.tensor)
        for part in parts[1:]:
            total.add_(part)
        for start, stop in gaps(mine, numel):  # nothing arrived there: the padding's zeros
            total[start:stop].zero_()

    return launch, add, total


def broadcast_per_chunk(group: Any, chunks: Sequence[torch.Tensor]) -> Launch:
    """An all-gather as one broadcast per owner chunk (this rank's chunk already in place)."""

    def launch() -> list[Any]:
        return [
            dist.broadcast(c, group=group, group_src=r, async_op=True) for r, c in enumerate(chunks)
        ]

    return launch
