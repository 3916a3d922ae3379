"""The schedule's reduce-scatters of units ([Note: stage-3 schedule] in hooks.py).

A unit's reduce-scatter is not issued where its backward ends (the post-backward callback) but
*deferred* to the next hook that issues collectives, in practice the pre-backward hook of the
unit before it, which fires right after: it goes into that hook's plan, under one order check
with the hook's own gathers (``OrderCheck.approve``: one rank-synchronising check per hook
instead of two). An item some rank cannot take part in yet ([Note: merged plans] in order.py)
stays deferred; the end of backward reduces every unit left, in unit order.
"""

from __future__ import annotations

from collections.abc import Callable

from zerodp.params.order import Op, OrderCheck
from zerodp.params.order_story import Item
from zerodp.params.reduce import ShardedGrads
from zerodp.params.unit import Trace, Unit


class Reductions:
    """The deferred reduce-scatters and how they are agreed on and issued."""

    def __init__(self, grads: Callable[[], ShardedGrads], check: OrderCheck, trace: Trace) -> None:
        # The schedule's reducer as it is now: unfreezing parameters rebuilds it.
        self._grads = grads
        self.check = check
        self.trace = trace
        self._deferred: list[Unit] = []  # backward done, reduce-scatter not issued yet

    def approve(self, plan: list[Item], blocked: bool = False) -> set[Item]:
        """The items of ``plan`` every rank agreed on (``OrderCheck.approve``)."""
        return {op for op, ok in zip(plan, self.check.approve(plan, blocked), strict=True) if ok}

    def plan(self, unit: Unit) -> list[Item]:
        """The checked collective ``reduce(unit)`` issues (none for a unit without buckets)."""
        if any(self._grads().reduce_plan(i) for i in unit.seg_ids):
            return [(Op.REDUCE, unit.index)]
        return []

    def deferred_plan(self) -> list[Item]:
        return [op for u in self._deferred for op in self.plan(u)]

    def defer(self, unit: Unit) -> None:
        """Issued by the next hook that issues collectives (``flush``)."""
        unit.reduced = True
        self._deferred.append(unit)

    def flush(self, agreed: set[Item]) -> None:
        """Reduce the deferred units every rank agreed on; the others stay deferred."""
        deferred, self._deferred = self._deferred, []
        for unit in deferred:
            if all(op in agreed for op in self.plan(unit)):
                self.reduce(unit)
            else:
                self._deferred.append(unit)

    def reduce(self, unit: Unit) -> None:
        """Reduce-scatter every segment of ``unit``: one checked collective."""
        if self.plan(unit):
            self.check(Op.REDUCE, unit.index)
            for i in unit.seg_ids:
                self._grads().reduce(i, checked=False)
            self.check.issue_extras()
        unit.reduced = True
        if unit.segments:
            self.trace("reduce", unit)

    def reduce_the_rest(self, units: list[Unit], persistent_seg_ids: list[int]) -> None:
        """The end of backward: every unit not reduce-scattered yet, in unit order (the same
        list on every rank once all are here: [Note: merged plans]), then the persistent
        segments; agreed again while other ranks are still in their backward."""
        deferred = {id(u) for u in self._deferred}
        left = [u for u in units if not u.reduced or id(u) in deferred]
        self._deferred = []
        for u in left:
            u.reduced = True
        segs = list(persistent_seg_ids)
        grads = self._grads()
        while left or segs:
            plan = [op for u in left for op in self.plan(u)]
            plan += [op for i in segs for op in grads.reduce_plan(i)]
            agreed = self.approve(plan, blocked=True)
            for u in [u for u in left if all(op in agreed for op in self.plan(u))]:
                self.reduce(u)
                left.remove(u)
            for i in [i for i in segs if all(op in agreed for op in grads.reduce_plan(i))]:
                grads.reduce(i)
                segs.remove(i)

    def clear(self) -> None:
        self._deferred.clear()
