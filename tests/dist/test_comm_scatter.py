"""Point-to-point reduce-scatter on gloo CPU ([Note: point-to-point reduce-scatter] in
comm/gloo_cpu.py): the same sums as the reduce-per-chunk path, several in flight at once
(waited for newest first), the receive buffer's size and the input's split checked, and the
same traffic in the ledger."""

from __future__ import annotations

from typing import Any

import pytest
import torch

TIMEOUT = 60.0
CHUNK = 1000  # elements each rank owns


def _contribution(rank: int, call: int, world: int) -> torch.Tensor:
    """Integer-valued floats: every summation order gives the same, exact sum."""
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randint(-1000, 1000, (world * CHUNK,), generator=g).float()


def case_point_to_point() -> dict[str, Any]:
    import torch.distributed as dist

    from zerodp.comm import Communicator

    comm = Communicator(None)
    n, rank = comm.world_size, comm.rank
    out: dict[str, Any] = {"receive_numel": comm.receive_numel(n * CHUNK, torch.device("cpu"))}
    expected = [sum(_contribution(r, c, n) for r in range(n)) for c in range(3)]
    own = slice(rank * CHUNK, (rank + 1) * CHUNK)

    # Three in flight at once, waited for newest first.
    inputs = [_contribution(rank, c, n) for c in range(3)]
    received = [torch.full((out["receive_numel"],), float("nan")) for _ in range(3)]
    outputs = [torch.empty(CHUNK) for _ in range(3)]
    handles = [
        comm.reduce_scatter(o, i, received=r, async_op=True)
        for o, i, r in zip(outputs, inputs, received, strict=True)
    ]
    for h in reversed(handles):
        h.wait()
    out["p2p"] = [torch.equal(o, e[own]) for o, e in zip(outputs, expected, strict=True)]
    # ... received point to point: each buffer holds the other ranks' contributions to this
    # rank's chunk, in rank order (not filled: gloo's reduce ran instead).
    peers = [r for r in range(n) if r != rank]
    out["received"] = [
        torch.equal(received[c], torch.cat([_contribution(r, c, n)[own] for r in peers]))
        for c in range(3)
    ]

    # In place (the output is this rank's chunk of the input), as the staging buffers use it.
    x = _contribution(rank, 0, n)
    comm.reduce_scatter(x[own], x, received=received[0])
    out["in_place"] = torch.equal(x[own], expected[0][own])

    # The reduce-per-chunk path (no receive buffer) gives the same sums.
    y = _contribution(rank, 1, n)
    comm.reduce_scatter(y[own], y)
    out["per_chunk"] = torch.equal(y[own], expected[1][own])

    try:
        comm.reduce_scatter(torch.empty(CHUNK), x, received=torch.empty(CHUNK * (n - 1) - 1))
        out["short"] = "no error"
    except ValueError as e:
        out["short"] = str(e)
    try:
        comm.reduce_scatter(torch.empty(CHUNK), torch.empty(n * CHUNK + 1), received=x)
        out["uneven"] = "no error"
    except ValueError as e:
        out["uneven"] = str(e)
    out["bytes"] = comm.ledger.current().to_dict()["bytes"]["reduce_scatter"]
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_reduce_scatter(world, world_size):
    n = world_size
    for o in world(n).run(case_point_to_point, timeout=TIMEOUT):
        assert o["receive_numel"] == (n - 1) * CHUNK
        assert o["p2p"] == [True, True, True]
        assert o["received"] == [True, True, True]
        assert o["in_place"] and o["per_chunk"]
        assert o["short"] == (
            f"received holds {(n - 1) * CHUNK - 1} elements, not {(n - 1) * CHUNK}"
        )
        assert o["uneven"] == (
            f"reduce_scatter of {n * CHUNK + 1} elements over {n} ranks: the input must split "
            "into equal chunks"
        )
        # Five reduce-scatters of N x CHUNK fp32 elements each (the refused one records none).
        assert o["bytes"] == 5 * n * CHUNK * 4


# Pieces of one rank's chunk: (start, stop) in the chunk; the gaps between them are padding.
PIECES = ((0, 300), (310, 700), (700, 990))


def _noise(rank: int, call: int, world: int) -> torch.Tensor:
    """Not integer-valued: a different order of additions would show in the last bits. Every
    fifth element is -0.0, which a sum keeps only if no +0.0 is added to it."""
    g = torch.Generator().manual_seed(1000 + 100 * call + rank)
    x = torch.randn(world * CHUNK, generator=g)
    x[::5] = -0.0
    return x


def _without(rank: int, call: int) -> set[int]:
    """Pieces this rank has no tensor for (a parameter without a gradient), by the data: on
    rank 1 only, so that other pieces sum as many terms as there are ranks."""
    return {call % len(PIECES)} if rank == 1 else set()


def _logical(rank: int, call: int, world: int) -> torch.Tensor:
    """The input the pieces stand for: zeros in the gaps and where a piece has no tensor."""
    x = torch.zeros(world * CHUNK)
    full = _noise(rank, call, world)
    for r in range(world):
        for k, (a, b) in enumerate(PIECES):
            if k not in _without(rank, call):
                x[r * CHUNK + a : r * CHUNK + b] = full[r * CHUNK + a : r * CHUNK + b]
    return x


def case_pieces() -> dict[str, Any]:
    import torch.distributed as dist

    from zerodp.comm import Communicator, Piece

    comm = Communicator(None)
    n, rank = comm.world_size, comm.rank
    own = slice(rank * CHUNK, (rank + 1) * CHUNK)
    receive = comm.receive_numel(n * CHUNK, torch.device("cpu"))
    out: dict[str, Any] = {}

    def chunks(call: int) -> list[list[Any]]:
        full = _noise(rank, call, n)
        return [
            [
                Piece(a, b - a, None)
                if k in _without(rank, call)
                else Piece(a, b - a, full[r * CHUNK + a : r * CHUNK + b].clone())  # its own
                for k, (a, b) in enumerate(PIECES)
            ]
            for r in range(n)
        ]

    # Three in flight at once, waited for newest first, each into a NaN-filled receive buffer
    # (the gaps must come out zero, not NaN).
    received = [torch.full((receive,), float("nan")) for _ in range(3)]
    launched = [comm.reduce_scatter_pieces(chunks(c), CHUNK, received[c]) for c in range(3)]
    for handle, _ in reversed(launched):
        handle.wait()
    # The staged path over the same logical inputs: the sums must agree bit for bit.
    staged = []
    for c in range(3):
        x = _logical(rank, c, n)
        comm.reduce_scatter(x[own], x, received=torch.empty(receive))
        staged.append(x[own])
    out["equal"] = [  # bit for bit: torch.equal takes -0.0 for +0.0
        torch.equal(t.view(torch.int32), s.view(torch.int32))
        for (_, t), s in zip(launched, staged, strict=True)
    ]
    out["lands_in_received"] = [
        t.data_ptr() == r.data_ptr() for (_, t), r in zip(launched, received, strict=True)
    ]
    out["gaps"] = [t[300:310].tolist() + t[990:].tolist() for _, t in launched]
    out["bytes"] = comm.ledger.current().to_dict()["bytes"]["reduce_scatter"]
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_from_pieces(world, world_size):
    """[Note: reduce-scatter from pieces]: the staged path's sums, bit for bit, for pieces
    that hold no tensor on some ranks and gaps that hold nothing."""
    n = world_size
    for o in world(n).run(case_pieces, timeout=TIMEOUT):
        assert o["equal"] == [True, True, True]
        assert o["lands_in_received"] == [True, True, True]
        assert o["gaps"] == [[0.0] * 20] * 3
        # Six reduce-scatters of N x CHUNK fp32 elements: three from pieces, three staged.
        assert o["bytes"] == 6 * n * CHUNK * 4
