"""What keeps a gathered unit gathered beyond its own forward and backward: prefetches, the
last units of the forward kept into the backward, attached units borrowed on demand; and the
release of a unit once nothing holds it (``Unit.held``).

[Note: keeping the last units]
The backward starts with the units the forward ended with. With ``Stage3.keep_last_units`` k
(at most ``prefetch_depth + 1``), the last k units of the recorded forward order (but the root,
and none before a unit that ran twice) are not released after their forward (``Unit.carried``):
the backward finds them gathered and issues no all-gather for them, 3Ψ - Ψ_kept per step. They
are released after their backward like any unit, or at the end of the backward. Keeping
k <= depth + 1 units holds no more than the bound (the running unit and ``depth`` prefetches):
in the forward, while the j-th of the last k units runs, the j - 1 kept before it, itself and
its prefetches (the k - j units after it, at most) are k units; in the backward the kept units
are prefetches made early: a unit's backward lets go of every kept unit that is neither among
the ``depth`` it expects next nor inside it (the root's backward encloses them all), so a
backward that does not start with them (another order, a kept unit whose backward never
comes) holds no more than its prefetches would. Every rank picks them from its own recorded
order, so ranks running the same graph keep the same units; where they differ
(mixture-of-experts routing) the order check merges the backward gathers as any others. The
first step, with nothing recorded, keeps none.
"""

from __future__ import annotations

from zerodp.params.prefetch import PassOrder
from zerodp.params.unit import Gatherer, Unit, UnitState


class Holding:
    """The schedule's holds on units that are not running: its prefetches, the kept last units
    and the borrowed attached units, and releasing what nothing holds."""

    def __init__(self, units: list[Unit], gatherer: Gatherer, keep: int) -> None:
        self.units = units
        self.gatherer = gatherer
        self.keep = keep  # [Note: keeping the last units]
        self._carry: set[int] = set()  # indices of the units this forward keeps
        # The units kept so far (a superset of those still ``carried``: the schedule clears the
        # flag after a unit's backward), so that no hook walks every unit to find them.
        self._kept: list[Unit] = []
        self._prefetched: list[Unit] = []

    # -- the last units of the forward ([Note: keeping the last units]) -----------------------

    def choose_carried(self, recorded: PassOrder, root: Unit) -> None:
        """A forward of the root starts: keep the last units of the ``recorded`` forward order;
        let go of those a forward kept that no backward followed."""
        self._carry = recorded.tail(self.keep, skip=root.index)
        kept, self._kept = self._kept, []
        for other in kept:
            if other.carried and not other.in_backward:
                other.carried = False
                self.release_unless_held(other)
            elif other.carried:
                self._kept.append(other)

    def carry(self, unit: Unit) -> None:
        """``unit``'s forward returned outputs the backward will reach: keep it if chosen."""
        if not unit.carried and unit.index in self._carry:
            unit.carried = True
            if unit not in self._kept:  # a stale entry (flag cleared since) stands for it
                self._kept.append(unit)

    def let_go_of_carried(self, unit: Unit, wanted: list[Unit]) -> None:
        """Release the kept units ``unit``'s backward neither expects next (``wanted``) nor
        encloses."""
        kept, self._kept = self._kept, []
        for other in kept:
            if not other.carried:
                continue
            if other.in_backward or other in wanted or unit.index in other.ancestors:
                self._kept.append(other)
            else:
                other.carried = False
                self.release_unless_held(other)

    # -- prefetches ---------------------------------------------------------------------------

    def use(self, unit: Unit) -> None:
        """``unit`` runs (or is read) now: gathered, or waited for, and no longer a prefetch."""
        if unit.prefetched:
            unit.prefetched = False
            self._prefetched.remove(unit)
        self.gatherer.unshard(unit)

    def prefetch(self, wanted: list[Unit]) -> None:
        """Release prefetches that are no longer expected (the bound on gathered memory counts
        ``depth`` of them), then start the gathers of ``wanted``."""
        self.drop_prefetches(wanted)
        for unit in wanted:
            if unit.state is UnitState.RELEASED:
                self.gatherer.start(unit)
                unit.prefetched = True
                self._prefetched.append(unit)

    def drop_prefetches(self, keep: list[Unit]) -> None:
        for unit in [u for u in self._prefetched if u not in keep]:
            unit.prefetched = False
            self._prefetched.remove(unit)
            self.release_unless_held(unit)

    def forget(self) -> None:
        """A reset: every unit's holds are cleared by the schedule, which then releases them."""
        self._prefetched.clear()
        self._kept.clear()

    # -- borrowed attached units and releasing -----------------------------------------------

    def return_borrowed(self) -> None:
        for unit in self.units:
            if unit.borrowed:
                unit.borrowed = False
                self.release_unless_held(unit)

    def release_unless_held(self, unit: Unit) -> None:
        if not unit.held:
            self.gatherer.release(unit)
