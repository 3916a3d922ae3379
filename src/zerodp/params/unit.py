"""A unit's lifecycle (released / gathering / gathered) and the all-gathers that drive it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerodp.comm import Communicator, Handle
from zerodp.offload.landing import Landing
from zerodp.params.order import Op, OrderCheck
from zerodp.params.policy import UnitSpec
from zerodp.params.segment import ShardedSegment

if TYPE_CHECKING:
    from zerodp.offload.home import ShardHome
    from zerodp.params.reuse import GatherMemory


@dataclass(frozen=True)
class Holds:
    """What one forward call of a unit started with ([Note: backward without parameters] in
    saved.py)."""

    counts: tuple[int, ...]  # per segment: the buffer's storage, then each parameter
    accumulators: list[Any]  # AccumulateGrad of each parameter that requires grad, held


class UnitState(enum.Enum):
    RELEASED = "released"
    """Full buffers freed; the parameters' ``.data`` are placeholders that must not be read."""
    GATHERING = "gathering"
    """All-gathers into the full buffers are in flight; ``.data`` are still placeholders."""
    GATHERED = "gathered"
    """The parameters' ``.data`` view the full buffers."""


@dataclass(eq=False)
class Unit:
    """One unit's tensors and state on this rank (see [Note: units] in ``policy.py``)."""

    spec: UnitSpec
    segments: list[ShardedSegment]  # one per dtype kind; usually one
    seg_ids: list[int]  # their indices in the engine's segment list
    ancestors: tuple[int, ...]  # enclosing units, innermost first
    state: UnitState = UnitState.RELEASED
    handles: list[Handle] = field(default_factory=list)
    # Who holds the unit gathered; it is released when nobody does (Holding.release_unless_held).
    active: int = 0  # forward calls in progress
    in_backward: bool = False  # its backward started and its gradients are not reduced yet
    prefetched: bool = False  # gathered ahead of its use, not used yet
    kept: bool = False  # the root, from its forward to the end of backward
    carried: bool = False  # a last unit of the forward, held into its backward
    recomputed: bool = False  # run in a recompute: held until its backward ([Note: recompute])
    borrowed: bool = False  # an attached unit read on demand: held as long as the root is kept
    hooked: bool = False  # its forward ran in this pass with outputs that backward will reach
    ready_grads: int = 0  # parameters whose gradient was accumulated in this backward
    # Its forward ran, or a parameter of it was read, since the last backward ended: it may get
    # a gradient in this backward ([Note: merged plans] in order.py).
    touched: bool = False
    pinned: int = 0  # full_parameters / state_dict / load_state_dict
    scoped: int = 0  # the root, while model.generate runs ([Note: inference] in hooks.py)
    # Per backward: post-backward callbacks still expected (one per forward call whose inputs
    # require grad) and whether the gradients were reduce-scattered.
    pending_post_backward: int = 0
    reduced: bool = False
    # A forward call in this pass had no input that requires grad, so no post-backward callback
    # tells when its backward is done: the gradients are complete when every parameter's
    # AccumulateGrad ran ([Note: stage-3 schedule] in hooks.py, "grad ready").
    untracked: bool = False
    # [Note: backward without parameters] in saved.py. Per pass: reference counts at the start
    # of its outermost forward call and whether its backward reads its parameters (None: not
    # measured, so it does). For good: a backward read them through the parameters although
    # the forward left no reference.
    refs: Holds | None = None
    backward_reads: bool | None = None
    read_in_backward: bool = False

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def module(self) -> nn.Module:
        return self.spec.module

    @property
    def gathered_for_backward(self) -> bool:
        """Not one whose backward all-gather is skipped ([Note: backward without parameters])."""
        return self.backward_reads is not False

    @property
    def held(self) -> bool:
        return bool(
            self.active
            or self.in_backward
            or self.prefetched
            or self.kept
            or self.carried
            or self.recomputed
            or self.borrowed
            or self.pinned
            or self.scoped
        )

    @property
    def num_params(self) -> int:
        return sum(len(s.params) for s in self.segments)

    @property
    def full_nbytes(self) -> int:
        return sum(s.full_nbytes for s in self.segments)

    @property
    def shard_nbytes(self) -> int:
        return sum(s.shard_nbytes for s in self.segments)


class Trace:
    """Optional record of lifecycle events ``(event, unit label)``, for tests and debugging:
    set ``events`` to a list to start recording."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] | None = None

    def __call__(self, event: str, unit: Unit) -> None:
        if self.events is not None and (unit.segments or event.startswith(("forward", "back"))):
            self.events.append((event, unit.label))


class Gatherer:
    """Starts, waits for and undoes the all-gathers of units, and accounts the bytes of
    gathered (unsharded) parameters: now and the peak."""

    def __init__(self, comm: Communicator, check: OrderCheck, trace: Trace) -> None:
        self.comm = comm
        self.check = check
        self.trace = trace
        self.gathered_bytes = 0
        self.peak_bytes = 0
        # Offloaded step: a shard is gathered only once its update landed ([Note: offloaded
        # step] in offload/runner.py).
        self.landing: Landing | None = None
        # Offloaded parameters: the shards rest off the device ([Note: offloaded parameters]).
        self.home: ShardHome | None = None
        # CPU: released memory kept for the next gather ([Note: reused gather memory]).
        self.memory: GatherMemory | None = None

    def _landed(self, seg: ShardedSegment) -> None:
        if self.landing is not None:
            self.landing.wait_segment(seg.index)

    def _source(self, seg: ShardedSegment, full: torch.Tensor) -> torch.Tensor:
        """The all-gather's input: the shard, or with offloaded parameters its copy staged into
        its own slice of ``full`` (the all-gather's output)."""
        if self.home is None or not self.home.holds(seg.index):  # a kept unit: on the device
            return seg.shard
        owned = full.narrow(0, seg.owned.start, seg.owned.numel)
        self.home.stage(seg, owned)
        return owned

    @staticmethod
    def start_plan(unit: Unit) -> list[tuple[Op, int]]:
        """The checked collective ``start(unit)`` will issue (``OrderCheck.approve``)."""
        if unit.state is UnitState.RELEASED and unit.segments:
            return [(Op.GATHER, unit.index)]
        return []

    def start(self, unit: Unit, private: bool = False) -> None:
        """RELEASED -> GATHERING: allocate the full buffers (``private``: fresh ones, for pins:
        [Note: pinned gathers] in ``segment.py``) and launch the all-gathers."""
        if unit.state is not UnitState.RELEASED:
            return
        if unit.segments:
            self.check(Op.GATHER, unit.index)
        for seg in unit.segments:
            self._landed(seg)
            seg.alloc(private, self.memory, self.gathered_bytes)
            self.gathered_bytes += seg.full_nbytes
            source = self._source(seg, seg.param_buffer)
            # [Note: parameters that view the shard] in segment.py
            seg.reads_shard = not private and source is seg.shard
            parts = seg.copied_parts if seg.reads_shard else None
            handle = self.comm.all_gather(seg.param_buffer, source, async_op=True, own_parts=parts)
            unit.handles.append(handle)
        unit.state = UnitState.GATHERING
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)
        self.trace("gather", unit)
        if unit.segments:
            self.check.issue_extras()

    def gather_extra(self, unit: Unit) -> None:
        """Take part in an all-gather of ``unit`` that other ranks need and this rank does not
        ([Note: merged plans] in order.py): into a scratch buffer, freed once it completes."""
        for seg in unit.segments:
            self._landed(seg)
            if self.memory is not None:
                self.memory.make_room(seg.full_nbytes, self.gathered_bytes)
            scratch = seg.param_buffer.new_empty(seg.layout.padded_numel)
            self.gathered_bytes += seg.full_nbytes
            self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)
            source = self._source(seg, scratch)
            self.comm.all_gather(scratch, source, async_op=True).wait()
            self.gathered_bytes -= seg.full_nbytes
            del scratch
        self.trace("gather_extra", unit)

    def wait(self, unit: Unit) -> None:
        """GATHERING -> GATHERED: the parameters become their full views."""
        if unit.state is not UnitState.GATHERING:
            return
        for h in unit.handles:
            h.wait()
        unit.handles.clear()
        for seg in unit.segments:
            seg.show_full()
        unit.state = UnitState.GATHERED
        self.trace("ready", unit)

    def unshard(self, unit: Unit) -> None:
        self.start(unit)
        self.wait(unit)

    def release(self, unit: Unit) -> None:
        """-> RELEASED: placeholders in, full buffers freed (after any in-flight gather, which
        must not write into freed memory)."""
        if unit.state is UnitState.RELEASED:
            return
        self.wait(unit)
        self.gathered_bytes -= unit.full_nbytes
        for seg in unit.segments:
            seg.release(self.memory, self.gathered_bytes)
        unit.state = UnitState.RELEASED
        self.trace("release", unit)

    @property
    def cached_bytes(self) -> int:
        """Released memory kept for the next gather ([Note: reused gather memory])."""
        return self.memory.cached_bytes if self.memory is not None else 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.gathered_bytes
