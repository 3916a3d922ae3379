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
