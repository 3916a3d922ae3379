"""The collectives this rank takes part in for the others: the extras of merged plans ([Note:
merged plans] in order.py) and the stand-ins after ranks parted from a replayed order ([Note:
verified orders] in replay.py). The schedule's ``OrderCheck.extras``."""

from __future__ import annotations

from collections.abc import Callable

from zerodp.params.order import Op
from zerodp.params.reduce import ShardedGrads
from zerodp.params.unit import Gatherer, Trace, Unit


class ScheduleExtras:
    """What ``OrderCheck`` asks of the stage-3 schedule for collectives it did not plan."""

    def __init__(
        self,
        units: list[Unit],
        gatherer: Gatherer,
        grads: Callable[[], ShardedGrads],
        persistent_seg_ids: list[int],
        trace: Trace,
        backward_open: Callable[[], bool],
    ) -> None:
        self.units = units
        self.gatherer = gatherer
        # The schedule's reducer as it is now: unfreezing parameters rebuilds it
        # (``ShardedParams.adopt``).
        self._grads = grads
        self.persistent_seg_ids = persistent_seg_ids
        self.trace = trace
        self._backward_open = backward_open

    @property
    def grads(self) -> ShardedGrads:
        return self._grads()

    def can(self, op: Op, index: int) -> bool:
        if index >= len(self.units) or not self.units[index].segments:
            return False
        if op is Op.GATHER:
            return True
        unit = self.units[index]
        # A reduce-scatter with zeros for a unit this rank will give no gradient in this
        # backward: it is in its backward (the forward is over) and the unit was not used.
        return (
            op is Op.REDUCE
            and self._backward_open()
            and self.grads.sync_enabled
            and not unit.touched
            and not unit.reduced
            and unit.ready_grads == 0
            and not unit.pending_post_backward
        )

    def planned(self, op: Op, index: int) -> None:
        if op is Op.REDUCE:
            self.units[index].reduced = True

    def issue(self, op: Op, index: int) -> None:
        unit = self.units[index]
        if op is Op.GATHER:
            self.gatherer.gather_extra(unit)
        else:
            for i in unit.seg_ids:
                self.grads.reduce(i, checked=False)
            self.trace("reduce_extra", unit)

    def stand_in(self, op: Op, index: int) -> None:
        if op is Op.GATHER:
            self.gatherer.gather_extra(self.units[index])
        elif index >= len(self.units):  # a persistent segment
            self.grads.reduce_zeros(self.persistent_seg_ids[index - len(self.units)])
        else:
            for i in self.units[index].seg_ids:
                self.grads.reduce_zeros(i)
