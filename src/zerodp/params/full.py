"""Full parameters outside forward: ``zerodp.full_parameters`` and ``state_dict`` support.

Both are built on *pins*: a pinned unit stays gathered until its last pin is removed
(``Unit.pinned``). Gathering is a collective, so every rank must enter ``full_parameters`` with
the same modules, and call ``model.state_dict()`` / ``model.load_state_dict()`` together (as
with FSDP's full state dict). Their traffic is not training traffic and is kept out of the
step's ``comm_stats``.

Writing back ([Note: writeback]): the edited full buffers are the truth; each rank copies its
owned slice into its shard. Under mixed precision only the elements that changed are copied
into the fp32 masters (cast), so parameters nobody touched keep their full fp32 precision.
With ``rank=r`` rank r's full buffers are first broadcast, so edits made on one rank (e.g. weight
surgery on rank 0) reach every shard; with ``rank=None`` every rank's own edits are used, which
is right when all ranks make the same edits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.params.segment import ShardedSegment
from zerodp.params.unit import Unit
from zerodp.partition.segment import Segment

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine
    from zerodp.optim.masters import Masters
    from zerodp.params.manager import ShardedParams


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
    engine: ZeroEngine | None = model.__dict__.get("_zero_engine")
    if engine is None:
        raise TypeError("full_parameters needs a model returned by zerodp.initialize")
    engine.wait_params()  # stages 1-2: the step's gather must land before reads and writeback
    sharded = engine.params
    units = sharded.units_of(modules) if sharded is not None else []
    segs = _segments_of(engine, modules)
    with engine.comm.untracked():
        if sharded is not None:
            sharded.pin(units)
    ok = False
    try:
        yield
        ok = True
    finally:
        with engine.comm.untracked():
            if ok and writeback:
                write_back(engine.comm, engine.masters, segs, rank)
                if rank is not None:
                    _broadcast_frozen(engine, modules, rank)
            if sharded is not None:
                sharded.unpin(units)


def write_back(
    comm: Communicator, masters: Masters, segs: Sequence[tuple[int, Segment]], rank: int | None
) -> None:
    """Make shards and masters of ``segs`` (index, segment) agree with their full buffers;
    see [Note: writeback]."""
    with torch.no_grad():
        for i, seg in segs:
            if rank is not None:
                comm.broadcast(seg.param_buffer, src=rank)
            _write_back_segment(i, seg, masters)


def _write_back_segment(i: int, seg: Segment, masters: Masters) -> None:
    master = masters.storage(i)
    if isinstance(seg, ShardedSegment):
        owned = seg.owned_view()
        if masters.separate:
            _copy_changed(master.data, owned, before=seg.shard)
        seg.shard.copy_(owned)
        return
    if not masters.separate:  # fp32 stages 0-2 / persistent: the masters view the parameters
        return
    params = seg.param_storage(masters.owner)
    for b in seg.layout.buckets:
        now = params.region(b.index)
        _copy_changed(master.region(b.index), now, before=master.region(b.index).to(now.dtype))


def _copy_changed(master: torch.Tensor, now: torch.Tensor, before: torch.Tensor) -> None:
    changed = now != before
    master[changed] = now[changed].to(master.dtype)


def _segments_of(
    engine: ZeroEngine, modules: Sequence[nn.Module] | None
) -> list[tuple[int, Segment]]:
    if modules is None:
        return list(enumerate(engine.segments))
    wanted = {id(p) for m in modules for p in m.parameters()}
    return [(i, s) for i, s in enumerate(engine.segments) if any(id(p) in wanted for p in s.params)]


def _broadcast_frozen(engine: ZeroEngine, modules: Sequence[nn.Module] | None, rank: int) -> None:
    wanted = None if modules is None else {id(p) for m in modules for p in m.parameters()}
    with torch.no_grad():
        for _, p in engine.frozen:
            if wanted is None or id(p) in wanted:
                engine.comm.broadcast(p.data, src=rank)


# -- state_dict / load_state_dict ---------------------------------------------------------------


class StateDictHooks:
    """``model.state_dict()`` returns full tensors (cloned, unit by unit); ``load_state_dict``
    writes into gathered parameters and then back to the shards. With ``keep_vars=True``
    (``state_dict`` returning the Parameter objects themselves) nothing is gathered."""

    def __init__(self, sharded: ShardedParams, masters: Masters, comm: Communicator) -> None:
        self.sharded = sharded
        self.masters = masters
        self.comm = comm
        self._stack: dict[int, list[list[Unit]]] = {}
        self.handles: list[Any] = []

    def install(self) -> None:
        for module, units, names in self.sharded.state_dict_modules():
            key = id(module)
            self.handles += [
                module.register_state_dict_pre_hook(partial(self._pre_save, key, units)),
                module.register_state_dict_post_hook(partial(self._post_save, key, names)),
                module.register_load_state_dict_pre_hook(partial(self._pre_load, key, units)),
                module.register_load_state_dict_post_hook(partial(self._post_load, key)),
            ]

    def _pin(self, key: int, units: list[Unit]) -> None:
        with self.comm.untracked():
            self.sharded.pin(units)
        self._stack.setdefault(key, []).append(units)

    def _unpin(self, key: int, writeback: bool) -> None:
        units = self._stack[key].pop()
        with self.comm.untracked():
            if writeback:
                outermost = [u for u in units if u.pinned == 1]
                segs = [
                    (i, s) for u in outermost for i, s in zip(u.seg_ids, u.segments, strict=True)
                ]
                write_back(self.comm, self.masters, segs, None)
                if self.sharded.units[0] in outermost:
                    write_back(self.comm, self.masters, self.sharded.persistent_segments(), None)
            self.sharded.unpin(units)

    def _pre_save(
        self, key: int, units: list[Unit], module: nn.Module, prefix: str, keep_vars: bool
    ) -> None:
        self._pin(key, [] if keep_vars else units)

    def _post_save(
        self,
        key: int,
        names: list[str],
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        meta: Any,
    ) -> None:
        for name in names:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                state_dict[prefix + name] = value.clone()  # the view dies with the release
        self._unpin(key, writeback=False)

    def _pre_load(self, key: int, units: list[Unit], module: nn.Module, *args: Any) -> None:
        self._pin(key, units)

    def _post_load(self, key: int, module: nn.Module, incompatible: Any) -> None:
        self._unpin(key, writeback=True)
