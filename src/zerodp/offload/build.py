"""Building the offloaded step for an engine: the optimizer's pieces cut into chunks, and the
``OffloadStep`` over them ([Note: offloaded step] in runner.py, [Note: offload chunks] in
chunks.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from zerodp.offload.chunks import chunk_numel, split_pieces
from zerodp.offload.grad_spill import GradSpill
from zerodp.offload.home import ShardHome
from zerodp.offload.landing import Landing
from zerodp.offload.runner import OffloadStep
from zerodp.offload.spill_check import SpillCheck
from zerodp.offload.swap import SwapStore
from zerodp.optim.masters import Masters
from zerodp.optim.pieces import OptimPiece
from zerodp.optim.runner import StepCheck
from zerodp.partition.layout import Piece
from zerodp.partition.segment import Segment
from zerodp.plan import Plan


def offload_pieces(
    plan: Plan,
    segments: list[Segment],
    per_seg: list[list[Piece]],
    owner: int,
    host: list[bool],
) -> list[list[Piece]]:
    """Each offloaded (``host``) segment's owned pieces cut at the chunk boundaries; the
    others' as they are (partial offload steps them on the device, as without offload)."""
    chunk = chunk_numel(plan.bucket_bytes)
    return [
        split_pieces(p, s.layout, owner, chunk) if on_host else p
        for p, s, on_host in zip(per_seg, segments, host, strict=True)
    ]


def offload_step(
    plan: Plan,
    segments: list[Segment],
    pieces: list[OptimPiece],
    masters: Masters,
    landing: Landing,
    order: list[tuple[int, int]],
    optimizer: torch.optim.Optimizer,
    home: ShardHome | None,
    spill: GradSpill | None,
    check: Callable[[], StepCheck] | None,
) -> OffloadStep:
    """``check``: builds the device runner over the *uncut* pieces, which checks and clips on
    the device exactly as without offload (a norm summed over other pieces would round
    differently); with the gradients on NVMe (``spill``) there is nothing on the device, and
    ``SpillCheck`` answers from the spill instead."""
    swap: Callable[..., SwapStore] | None = None
    if plan.offload_optimizer == "nvme":
        assert plan.offload_path is not None
        swap = partial(
            SwapStore,
            landing.streams,
            plan.offload_path,
            masters.rank,
            pieces=pieces,
            optimizer=optimizer,
            masters=masters,
            slots=plan.offload_ring,
        )
    if spill is not None:
        device: StepCheck = SpillCheck(spill, landing.streams.device)
    else:
        assert check is not None
        device = check()
    chunk = chunk_numel(plan.bucket_bytes)
    args = (segments, pieces, masters, device, landing, order, plan.offload_ring, chunk)
    return OffloadStep(*args, swap, home, spill, grad_ring=plan.offload_grad_ring)
