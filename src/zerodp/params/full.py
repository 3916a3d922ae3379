"""``zerodp.full_parameters``: full parameters outside forward, for inspection, generation loops
or weight surgery.

Built on *pins* (``Unit.pinned``, stage 3): a pinned unit stays gathered until its last pin is
removed. Gathering is a collective, so every rank must enter ``full_parameters`` with the same
modules. On exit, edits are written back ([Note: writeback] in ``state_dict.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from zerodp.params.state_dict import write_back
from zerodp.partition.segment import Segment
from zerodp.views import ParamAccess


class _Engine(Protocol):
    def wait_params(self) -> None: ...

    def param_access(self) -> ParamAccess: ...


@contextmanager
def full_parameters(
    model: nn.Module,
    modules: Sequence[nn.Module] | None = None,
    *,
    writeback: bool = True,
    rank: int | None = None,
) -> Iterator[None]:
    """Gather the full parameters of ``modules`` (default: the whole model) of a model returned
    by ``zerodp.initialize``, for inspection, generation loops or weight surgery.

    Inside the block the parameters are ordinary full tensors. On a normal exit with
    ``writeback`` (default), edits are written back to the shards and fp32 masters: every rank's
    own edits (``rank=None``, right when all ranks edit alike) or rank ``rank``'s, broadcast
    first. Then the parameters are released again. Call on every rank, with the same modules.
    Under stages 0-2 parameters are always full: only the writeback (masters, ``rank``) applies.
    """
    engine: _Engine | None = model.__dict__.get("_zero_engine")
    if engine is None:
        raise TypeError("full_parameters needs a model returned by zerodp.initialize")
    engine.wait_params()  # stages 1-2: the step's gather must land before reads and writeback
    access = engine.param_access()
    sharded = access.sharded
    units = sharded.units_of(modules) if sharded is not None else []
    segs = _segments_of(access, modules)
    with access.comm.untracked():
        if sharded is not None:
            sharded.pin(units)
    ok = False
    try:
        yield
        ok = True
    finally:
        with access.comm.untracked():
            if ok and writeback:
                write_back(
                    access.comm, access.masters, segs, rank, sharded.home if sharded else None
                )
                if rank is not None:
                    _broadcast_frozen(access, modules, rank)
            if sharded is not None:
                sharded.unpin(units)


def _segments_of(
    access: ParamAccess, modules: Sequence[nn.Module] | None
) -> list[tuple[int, Segment]]:
    if modules is None:
        return list(enumerate(access.segments))
    wanted = {id(p) for m in modules for p in m.parameters()}
    return [(i, s) for i, s in enumerate(access.segments) if any(id(p) in wanted for p in s.params)]


def _broadcast_frozen(access: ParamAccess, modules: Sequence[nn.Module] | None, rank: int) -> None:
    wanted = None if modules is None else {id(p) for m in modules for p in m.parameters()}
    with torch.no_grad():
        for _, p in access.frozen:
            if wanted is None or id(p) in wanted:
                access.comm.broadcast(p.data, src=rank)
