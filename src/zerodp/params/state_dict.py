"""Stage 3's ``state_dict`` / ``load_state_dict`` of full tensors, and the writeback of edited
full parameters into shards and masters (also what ``zerodp.full_parameters`` uses).

Both are built on *pins*: a pinned unit stays gathered until its last pin is removed
(``Unit.pinned``). Gathering is a collective, so every rank must call ``model.state_dict()`` /
``model.load_state_dict()`` together (as with FSDP's full state dict). Their traffic is not
training traffic and is kept out of the step's ``comm_stats``.

Writing back ([Note: writeback]): the edited full buffers are the truth; each rank copies its
owned slice into its shard. Under mixed precision only the elements that changed are copied
into the fp32 masters (cast), so parameters nobody touched keep their full fp32 precision.
With ``rank=r`` rank r's full buffers are first broadcast, so edits made on one rank (e.g. weight
surgery on rank 0) reach every shard; with ``rank=None`` every rank's own edits are used, which
is right when all ranks make the same edits.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.offload.home import ShardHome, resident
from zerodp.optim.masters import Masters
from zerodp.params.manager import ShardedParams
from zerodp.params.segment import ShardedSegment
from zerodp.params.unit import Unit
from zerodp.partition.segment import Segment


def write_back(
    comm: Communicator,
    masters: Masters,
    segs: Sequence[tuple[int, Segment]],
    rank: int | None,
    home: ShardHome | None = None,
) -> None:
    """Make shards and masters of ``segs`` (index, segment) agree with their full buffers;
    see [Note: writeback]. ``home``: where offloaded shards rest."""
    with torch.no_grad(), masters.resident(write=True), resident(home, write=True):
        for i, seg in segs:
            if rank is not None:
                comm.broadcast(seg.param_buffer, src=rank)
            _write_back_segment(i, seg, masters)


def _write_back_segment(i: int, seg: Segment, masters: Masters) -> None:
    master = masters.storage(i)
    if isinstance(seg, ShardedSegment):
        owned = seg.owned_view()
        if masters.is_separate(i):
            _copy_changed(master.data, owned, before=seg.shard.to(owned.device))
        seg.shard.copy_(owned)
        return
    if not masters.is_separate(i):  # fp32 stages 0-2 / persistent: the masters view the parameters
        return
    params = seg.param_storage(masters.owner)
    for b in seg.layout.buckets:
        now = params.region(b.index)
        _copy_changed(master.region(b.index), now, before=master.region(b.index).to(now))


def _copy_changed(master: torch.Tensor, now: torch.Tensor, before: torch.Tensor) -> None:
    """Compared where the parameters are; offloaded masters are in host memory."""
    changed = now != before
    master[changed.to(master.device)] = now[changed].to(master.device, master.dtype)


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
                write_back(self.comm, self.masters, segs, None, self.sharded.home)
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
