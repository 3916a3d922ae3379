"""A stage-3 segment: the parameters of one unit and dtype, sharded at rest.

[Note: sharded storage]
Each unit segment has one bucket covering it (see [Note: flat buffers]), so rank r owns the r-th
contiguous 1/N of the unit and one collective gathers or reduces the whole unit. At rest a rank
holds only ``shard`` (its 1/N, the all-gather input, and what the optimizer updates in fp32
training). ``param_buffer`` is one persistent tensor whose *storage* is resized to 0 at rest and
back while gathered, and ``views`` are the parameters' full-shape views of it, made once: autograd
saves views of parameters in forward, and those keep pointing at the same storage object, so
they are valid again after the re-gather in backward (FSDP1's trick). Memory is really freed
(on CPU: kept for the next gather of that size, under the gather bound, [Note: reused gather
memory] in reuse.py).

A parameter's ``.data`` is its view while gathered and a *placeholder* at rest; see
[Note: released placeholders] below and [Note: safe reads] in ``access.py``.

[Note: parameters that view the shard]
A parameter lying wholly in this rank's slice has its values in ``shard`` already: while a
schedule gather is in place its ``.data`` views the shard, and the gather copies into the full
buffer's own chunk only the rest of the slice (``copied_parts``: the parameters that straddle
a boundary, and padding), where copying the slice was a pass over 1/N of the unit per gather.
The views are made at each such gather and dropped at its release, so a shard that the offload
replaces is never kept alive. What autograd saves of them holds the shard's storage, which
outlives every gather and changes only at the step, a load or a writeback: a backward reads it
without a gather, so [Note: backward without parameters] in saved.py counts the full buffer's
storage only. Not done where the shard is not the gather's input (offloaded parameters stage
it into the own chunk) nor for private gathers ([Note: pinned gathers]). A unit that a pin finds
gathered by the schedule turns to the full buffer's views first (``show_buffer``), so that
edits inside ``full_parameters`` land in one place and its writeback, which reads the own
chunk, sees them; and from then on its gathers copy the whole slice, as before: a forward run
meanwhile may have saved views of the buffer's own chunk, which a later gather must refill.
An in-place write to a gathered parameter outside ``full_parameters`` (unsupported: it was lost
at the release) now reaches the shard where the parameter views it.

[Note: released placeholders]
A placeholder is a one-element tensor (NaN) expanded to the full shape: stride 0 everywhere, so
shape, dtype and device are right for code that inspects them, and every element of the view
lies inside its 1-element storage: no read of it, by any path, can leave its storage (the worst
a read that bypasses ``ShardedParameter``'s checks can see is NaN). The obvious alternative, a
full-shape view over a storage of 0 bytes (what the gathered views are at rest), is NOT safe:
torch does not bounds-check reads of an existing view against its storage, so ``tolist()``,
``sum()``, ``clone()``, ``numpy()`` of such a view dereference a null pointer plus the offset
(a segfault, measured on torch 2.13 CPU) or read foreign memory.

[Note: pinned gathers]
The views of ``param_buffer`` are shared with whatever took an alias of a gathered parameter
(``p.detach()``, ``p.data``, ``p[0]``): after the release such an alias is a view over a freed
storage, i.e. exactly the unsafe tensor above. Autograd's saved views need that sharing (they
are only read in backward, after the re-gather), but a user's alias does not. Gathers for
``full_parameters`` / ``state_dict`` / ``load_state_dict`` (``private=True``) therefore gather
into a fresh buffer of their own, which the release drops instead of resizing: an alias taken
inside ``with zerodp.full_parameters(model):`` keeps that memory alive and keeps the values it
had when the block ended, like any tensor. A unit that was already gathered by the schedule
when it was pinned keeps using the shared buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zerodp.partition.buffers import OwnedStorage, ShardBuffer, flat_view
from zerodp.partition.layout import Range
from zerodp.partition.segment import Segment

if TYPE_CHECKING:
    from zerodp.params.reuse import GatherMemory


@dataclass(eq=False)
class ShardedSegment(Segment):
    """``Segment`` whose ``param_buffer`` is allocated only while gathered; see
    [Note: sharded storage]."""

    rank: int
    shard: torch.Tensor  # 1D, layout.shard_numel: this rank's slice, the all-gather input
    views: list[torch.Tensor]  # by slot: full-shape views of param_buffer
    placeholders: list[torch.Tensor]  # by slot: what .data is at rest
    # The buffer schedule gathers use (storage resized to 0 at rest) and its views; while a
    # private gather is in place, param_buffer / views are another buffer ([Note: pinned
    # gathers]).
    resident: torch.Tensor  # 1D, padded_numel
    resident_views: list[torch.Tensor]
    # [Note: parameters that view the shard]: per slot, (offset in the shard, elements, shape)
    # of each parameter lying wholly in the owned slice (None for the others); the slice's
    # other parts (start, stop in it); whether the gather in place or in flight leaves those
    # parameters viewing the shard (set when it starts).
    inside: list[tuple[int, int, tuple[int, ...]] | None] = field(default_factory=list)
    copied_parts: list[tuple[int, int]] = field(default_factory=list)
    reads_shard: bool = False

    @classmethod
    def from_segment(
        cls, seg: Segment, rank: int, shard: torch.Tensor | None = None
    ) -> ShardedSegment:
        """Take over a built (gathered) segment, keep this rank's slice (in ``shard`` if given,
        a preallocated 1D tensor of ``shard_numel``) and release the rest."""
        assert len(seg.layout.buckets) <= 1, "a unit segment is one bucket"
        out = cls(
            seg.index,
            seg.layout,
            seg.params,
            seg.names,
            seg.dtype,
            seg.device,
            seg.param_buffer,
            rank,
            torch.empty(0),
            [],
            [],
            seg.param_buffer,
            [],
        )
        owned = flat_view(seg.param_buffer, out.owned)
        out.shard = owned.clone() if shard is None else shard.copy_(owned)
        out._make_views()
        out._find_inside()
        out.release()
        return out

    @property
    def owned(self) -> Range:
        """This rank's slice of the flat space (one bucket: a contiguous 1/N)."""
        if not self.layout.buckets:
            return Range(0, 0)
        return self.layout.buckets[0].shard(self.rank)

    def param_storage(self, owner: int | None) -> OwnedStorage:
        """At rest a rank holds only its shard ([Note: sharded storage])."""
        assert owner == self.rank, "stage 3 shards the optimizer"
        return ShardBuffer(self.shard, self.layout, self.rank)

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.param_buffer.element_size()

    @property
    def shard_nbytes(self) -> int:
        """Of the shard held now (0 while it rests on NVMe: [Note: offloaded parameters])."""
        return self.shard.numel() * self.shard.element_size()

    @property
    def shard_numel_bytes(self) -> int:
        """Of this rank's shard, wherever it rests."""
        return self.layout.shard_numel * self.dtype.itemsize

    # -- lifecycle (driven by zerodp.params.unit) --------------------------------------------

    def alloc(
        self, private: bool = False, memory: GatherMemory | None = None, in_use: int = 0
    ) -> None:
        """Give the full buffer its memory back (uninitialised: the all-gather fills it), from
        ``memory`` when given, with ``in_use`` bytes gathered besides ([Note: reused gather
        memory] in reuse.py); with ``private``, a fresh buffer the release drops ([Note: pinned
        gathers])."""
        if private:
            if memory is not None:
                memory.make_room(self.full_nbytes, in_use)
            self.param_buffer = torch.empty(
                self.layout.padded_numel, dtype=self.dtype, device=self.device
            )
            self.views = [self.param_view(slot.index) for slot in self.layout.slots]
            return
        storage = self.param_buffer.untyped_storage()
        if storage.nbytes() == 0:
            if memory is None:
                storage.resize_(self.full_nbytes)
            else:
                memory.fill(storage, self.full_nbytes, in_use)

    def show_full(self) -> None:
        """The parameters become their full views (with ``reads_shard``, those of the shard
        where they lie in it: [Note: parameters that view the shard])."""
        if not self.reads_shard:
            for p, view in zip(self.params, self.views, strict=True):
                p.data = view
            return
        shard = self.shard
        for p, view, inside in zip(self.params, self.views, self.inside, strict=True):
            if inside is None:
                p.data = view
            else:
                start, numel, shape = inside
                p.data = shard.narrow(0, start, numel).view(shape)

    def show_buffer(self) -> None:
        """Parameters that view the shard view the full buffer instead, its own chunk filled
        from the shard ([Note: parameters that view the shard])."""
        if not self.reads_shard:
            return
        self.owned_view().copy_(self.shard)
        self.reads_shard = False
        self.show_full()
        self.inside = [None] * len(self.inside)  # for good: later gathers copy the whole slice
        self.copied_parts = [(0, self.owned.numel)] if self.owned.numel else []

    def release(self, memory: GatherMemory | None = None, in_use: int = 0) -> None:
        """Point the parameters at their placeholders and free the full buffer (or hand its
        memory to ``memory``, with ``in_use`` bytes gathered besides)."""
        for p, placeholder in zip(self.params, self.placeholders, strict=True):
            p.data = placeholder
        self.reads_shard = False
        if self.param_buffer is self.resident:
            if memory is None:
                self.param_buffer.untyped_storage().resize_(0)
            else:
                memory.take(self.param_buffer.untyped_storage(), in_use)
        else:  # freed once no alias of it is left ([Note: pinned gathers])
            self.param_buffer, self.views = self.resident, self.resident_views

    def owned_view(self) -> torch.Tensor:
        """This rank's slice of the (gathered) full buffer."""
        return flat_view(self.param_buffer, self.owned)

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-store in ``dtype`` (mixed precision's compute copy), at rest."""
        if dtype == self.dtype:
            return
        self.shard = self.shard.to(dtype)
        self.dtype = dtype
        self.param_buffer = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)
        self._make_views()
        self.release()

    def _find_inside(self) -> None:
        owned = self.owned
        self.inside, self.copied_parts, cursor = [], [], 0
        for slot in self.layout.slots:
            start, stop = slot.flat.start - owned.start, slot.flat.stop - owned.start
            if slot.flat.numel == 0 or start < 0 or stop > owned.numel:
                self.inside.append(None)
                continue
            self.inside.append((start, slot.flat.numel, slot.spec.shape))
            if start > cursor:
                self.copied_parts.append((cursor, start))
            cursor = stop
        if owned.numel > cursor:
            self.copied_parts.append((cursor, owned.numel))

    def _make_views(self) -> None:
        """Views must be made while the storage is allocated (a view of a 0-byte storage fails
        its bounds check); they stay valid across later resizes of that storage."""
        self.resident = self.param_buffer
        self.alloc()
        self.views = [self.param_view(slot.index) for slot in self.layout.slots]
        self.resident_views = self.views
        # [Note: released placeholders]: stride 0 over one real element, never a 0-byte storage.
        # The element is 0-dim so that it expands to any shape, a 0-dim parameter's included.
        base = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
        self.placeholders = [base.expand(slot.spec.shape) for slot in self.layout.slots]
