"""Detecting ranks whose stage-3 collectives diverge, before they can hang.

Collectives are matched by the order they are issued in, not by what they carry. If a unit runs
on some ranks but not others (data-dependent control flow), one rank would all-gather unit k
while another all-gathers unit k+1 or reduce-scatters: a hang or silently mixed data. So before
every unit all-gather and reduce-scatter, and once before the step's agreement all-reduce, all
ranks exchange (operation, unit, error flag) in one tiny all-gather (``CONTROL`` traffic, not
counted as model data). Any difference raises the same ``RuntimeError`` on every rank, naming
what each rank was about to do. Because every stage-3 collective is preceded by a check of the
same shape, the first divergent point always meets a check on every rank.

The check is one small collective; blocking, it makes every rank wait for the slowest to reach
the same point (measured: that synchronisation, not the collective's latency, is its cost), so
once a step has run alike on every rank the next ones replay its order and check it later
without waiting, one row per block of exchanges ([Note: verified orders] in replay.py). Also
where one hook is about to issue several collectives (the backward hook of a unit reduce-scatters
the unit that just finished and prefetches the next one; the end of backward reduces every unit
left), ``approve`` agrees on the whole plan, up to ``PLAN_SLOTS`` collectives per exchange, and
each collective of the plan then goes ahead without an exchange of its own: about 2 checks per
unit per step instead of 3. A plan is compared as a whole, slot by slot (a single check is a plan
of one), so a rank that plans something else still meets the others at an exchange of the same
shape and every rank raises. Each exchange also carries a *marker* column (``mark``): what the
rank started since the last exchange (a training forward, a forward without gradients,
``generate``), so ranks doing different kinds of work over the same units are told apart with
no extra exchange ([Note: inference] in hooks.py). ``ZeroConfig.stage3.check_unit_order=False``
skips the checks once a model is known to run the same units on every rank; ``"exchange"``
keeps every exchange blocking (no replay).

[Note: merged plans]
Ranks may run different units (top-1 MoE routing, a layer dropped on one rank, a branch taken on
some ranks): every rank learns every plan at the exchange, so where plans differ they are
merged instead of refused. A second small all-gather tells, per item of the union, whether each
rank can take part: a rank that did not plan an all-gather joins it as an *extra* (into a
scratch buffer freed as soon as it completes: at most one unit more than the bound, briefly); a
rank that did not plan a reduce-scatter joins it with zeros only if it is in the same backward
(``backwards`` column) and the unit was not used there since the last backward (``touched``), so
no gradient can arrive later; else the reduce-scatter is left for later on the ranks that
planned it (they keep the gradients; the end of backward reduces what is left, in unit order).
The agreed items are issued in one order that contains every rank's plan as a subsequence
(``merge_plans``, the same on every rank); extras are issued before the next own collective or right
after the last (``issue_extras``). A rank that cannot go on until its items are agreed (the end
of backward, the step, a buffer broadcast, a checkpoint) exchanges again while the others run:
their exchanges pair with its repeats. Where nothing can be agreed and every rank waits (one
more backward on one rank than on another), or two ranks order the same gathers differently,
every rank raises the divergence error. Markers that differ only by a rank not starting
anything wait for the next exchange. Cost: an all-gather or reduce-scatter of each unit run
anywhere, on every rank, plus one control all-gather per differing exchange.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import NoReturn, Protocol

import torch

from zerodp.comm import Communicator
from zerodp.params.order_rows import (
    BACKWARDS,
    BLOCKED,
    COMMITTED,
    ERROR,
    HEAD,
    LEFT,
    LENGTH,
    MARKER,
    POSITION,
    plan_of,
    slots,
    step_position,
)
from zerodp.params.order_story import (
    Item,
    Op,
    divergence_message,
    first_difference,
    merge_plans,
    replayed_divergence,
    reported_message,
)
from zerodp.params.replay import PLAN_SLOTS, CommittedRows, Entry, Replay

__all__ = ["PLAN_SLOTS", "Extras", "Op", "OrderCheck"]


class Extras(Protocol):
    """What the schedule does for collectives other ranks planned and this rank did not
    ([Note: merged plans]), or issued after a divergence ([Note: verified orders])."""

    def can(self, op: Op, index: int) -> bool:
        """Whether this rank can issue ``op`` on ``index`` as an extra now."""
        ...

    def planned(self, op: Op, index: int) -> None:
        """It will (the state changes now: a unit reduced as an extra is reduced)."""
        ...

    def issue(self, op: Op, index: int) -> None:
        """Issue it (in the merged order)."""
        ...

    def stand_in(self, op: Op, index: int) -> None:
        """Take part in it whatever this rank's state, changing none of it (the ranks diverged
        and are about to raise): all-gather into scratch, reduce-scatter zeros."""
        ...


class _GathersOnly:
    def can(self, op: Op, index: int) -> bool:
        return False

    def planned(self, op: Op, index: int) -> None:
        raise AssertionError("no extras without a schedule")

    def issue(self, op: Op, index: int) -> None:
        raise AssertionError("no extras without a schedule")

    def stand_in(self, op: Op, index: int) -> None:
        raise AssertionError("no extras without a schedule")


class OrderCheck:
    """Agreement of all ranks on the next stage-3 collectives (see module docstring)."""

    def __init__(
        self,
        comm: Communicator,
        labels: list[str],
        enabled: bool | str,
        device: torch.device,
    ) -> None:
        self.comm = comm
        self.device = device
        self.labels = labels  # what each index names: units, then persistent segments
        self.enabled = bool(enabled) and comm.world_size > 1
        self.error = ""  # a local problem every rank must learn about (raised at the next check)
        self.calls = 0  # blocking exchanges so far
        self.committed = 0  # rows sent without waiting ([Note: verified orders])
        self.merges = 0  # exchanges whose plans differed and were merged
        self._extras: Callable[[], Extras | None] = lambda: None
        self.backwards = 0  # backward passes begun (set by the schedule)
        # Agreed and not issued yet, in the merged order: (op, index, this rank's own?).
        self._sequence: deque[tuple[Op, int, bool]] = deque()
        self._marker = Op.NOTHING  # sent with the next exchange
        self._positions: list[int] = []  # every rank's step position at the last exchange
        self._left = -1  # where this rank left a block it promised ([Note: verified orders])
        self.replay = Replay(self.enabled and enabled != "exchange")
        self._rows = CommittedRows()

    @property
    def extras(self) -> Extras:
        return self._extras() or _GathersOnly()

    @extras.setter
    def extras(self, extras: Extras) -> None:
        # A weak reference: the schedule owns the check, and nothing of it may be reachable
        # through the model but by its hooks (``copy.deepcopy`` of a model must meet a
        # parameter first, [Note: safe reads] in access.py).
        self._extras = weakref.ref(extras)

    def __call__(self, op: Op, index: int = -1) -> None:
        """Agree with every rank that the next collective is ``op`` on ``index``: consumes the
        approval ``approve`` gave it, or agrees on a plan of one (exchanging until every rank
        can issue it)."""
        if not self.enabled:
            self._raise_local()
            return
        self.issue_extras()
        if not self._sequence:
            while not self.approve([(op, index)], blocked=True)[0]:
                pass
            self.issue_extras()
        expected = self._sequence.popleft()
        if expected != (op, index, True):  # the schedule must issue exactly what it planned
            raise RuntimeError(
                f"zerodp internal error: planned {expected}, about to issue {(op, index)}"
            )

    def issue_extras(self) -> None:
        """Issue the agreed extras that come before this rank's next own collective (all of
        them if none is left): called before and after every own collective."""
        while self._sequence and not self._sequence[0][2]:
            op, index, _ = self._sequence.popleft()
            self.extras.issue(op, index)

    def mark(self, marker: Op) -> None:
        """Agree on what this rank starts (a training forward, an inference forward,
        ``generate``) in the next exchange: one more column of the row every exchange sends
        anyway, so it costs nothing. ``Op.NOTHING`` drops a marker no exchange took."""
        if self.enabled:
            self._marker = marker

    def approve(self, plan: list[Item], blocked: bool = False) -> list[bool]:
        """Agree with every rank on the next collectives, in order (see the module
        docstring); the matching calls then need no exchange. Returns, per item of ``plan``,
        whether it was agreed: an item is left out only where some rank cannot issue it now
        ([Note: merged plans]), then the caller issues it later (a deferred reduce-scatter) or
        calls again (``blocked``: the caller cannot go on before it is agreed)."""
        if not self.enabled:
            self._raise_local()
            return [True] * len(plan)
        if not plan:
            return []
        self.issue_extras()
        if self._sequence:
            raise RuntimeError(f"zerodp internal error: {list(self._sequence)} not issued")
        entry: Entry = (int(self._marker), tuple(plan))
        replay = self.replay
        if replay.in_block():  # [Note: verified orders]: promised when the block's row was sent
            if replay.expects(entry):
                return self._agreed(entry)
            self._leave_block()
        elif not self.error and replay.expects(entry) and replay.starts_block():
            self._check_rows(replay.position - 1)
            self._commit(replay.position, plan)
            replay.promise()
            return self._agreed(entry)
        self._check_rows(replay.position)  # every older row, before exchanging blocking
        plans, head = self._exchange(plan, blocked)
        if any(row[COMMITTED] for row in head):  # others follow the prediction: diverged
            self._replay_diverged(plans, head, replay.padding(replay.position))
        self._check_head(head)
        if any(row[LEFT] >= 0 for row in head):
            if len({row[LEFT] for row in head}) > 1:  # some ranks left a block, not all alike
                self._replay_diverged(plans, head, range(0))  # every rank is here
            self._left = -1  # every rank left at the same point: the step changed everywhere
            replay.drop()
        if all(p == plan for p in plans):
            if len({row[MARKER] for row in head}) > 1:  # same plan, different kinds of work
                self._diverged([(Op(row[MARKER]), -1) for row in head])
            return self._agreed(entry)
        self.replay.off()
        if len(set(self._positions)) > 1:  # ranks at different steps: never merged
            self._diverged(first_difference(plans))
        # Markers: the ranks are not at the same point; a marker no rank contradicts waits.
        if len({row[MARKER] for row in head}) == 1:
            self._marker = Op.NOTHING
        union = sorted({c for p in plans for c in p})
        same_pass = len({row[BACKWARDS] for row in head}) == 1
        bits = [int(c in plan or self._can_extra(c, same_pass)) for c in union]
        everyone = self.comm.all_gather_control(
            torch.tensor(bits, dtype=torch.int64, device=self.device)
        ).reshape(len(head), len(union))
        self.calls += 1
        self.merges += 1
        agreed = {c for k, c in enumerate(union) if bool(everyone[:, k].all())}
        if not agreed and all(row[BLOCKED] for row in head):  # nobody can go on
            self._diverged(first_difference(plans))
        while True:
            lists = [[c for c in p if c in agreed] for p in plans]
            order = merge_plans(lists)
            if order is not None:
                break
            # Two ranks order the same collectives differently (a rank at the end of its
            # backward reduces in unit order, another in the order its hooks ran): leave a
            # reduce-scatter for later, never a gather (a rank needs its gathers now).
            late = next((q[0] for q in lists if q and q[0][0] is Op.REDUCE), None)
            if late is None:
                self._diverged(first_difference(plans))
            agreed.discard(late)
        for op, i in order:
            own = (op, i) in plan
            if not own:
                self.extras.planned(op, i)
            self._sequence.append((op, i, own))
        return [c in agreed for c in plan]

    def _leave_block(self) -> None:
        """This rank's plan is not the one it promised: issue what the ranks that keep the
        promise issue until the block ends (standing in, nothing of this rank changes), then
        exchange blocking, telling where it left (``left`` column)."""
        self._left = self.replay.position
        self._stand_in(self.replay.leave())

    def _agreed(self, entry: Entry) -> list[bool]:
        """Every rank plans ``entry``: issue it as it is."""
        self._marker = Op.NOTHING
        self._sequence.extend((op, i, True) for op, i in entry[1])
        self.replay.advance(entry)
        if entry[1] == ((Op.STEP, -1),):
            self.replay.end_step()
        return [True] * len(entry[1])

    def _can_extra(self, item: Item, same_pass: bool) -> bool:
        op, index = item
        if op is Op.GATHER or (op is Op.REDUCE and same_pass):
            return self.extras.can(op, index)
        return False

    def _raise_local(self) -> None:
        if self.error:
            error, self.error = self.error, ""
            raise RuntimeError(error)

    def _row(self, part: list[Item], blocked: bool, committed: bool) -> torch.Tensor:
        """The first row of an exchange: the head, then up to ``PLAN_SLOTS`` items."""
        # The columns of order_rows, in their order.
        head = [int(bool(self.error)), int(self._marker), step_position(self.comm), int(blocked)]
        head += [self.backwards, len(part), int(committed), self._left]
        return torch.tensor(head + slots(part[:PLAN_SLOTS]), dtype=torch.int64, device=self.device)

    def _commit(self, position: int, plan: list[Item]) -> None:
        """Send this rank's row for ``position`` without waiting; checked later."""
        handle, rows = self.comm.all_gather_control_async(self._row(plan, False, True))
        self._rows.add(position, handle, rows)
        self.committed += 1

    def _exchange(
        self, plan: list[Item], blocked: bool
    ) -> tuple[list[list[Item]], list[list[int]]]:
        """Every rank's plan and head row (the columns of order_rows: error, marker, position,
        blocked, backwards, length, committed, left): one all-gather of ``PLAN_SLOTS`` items,
        and more only where a plan is longer (every rank learns the longest length from the
        first) and no rank committed its row (a committed rank sends one)."""
        rows = self.comm.all_gather_control(self._row(plan, blocked, False)).tolist()
        self.calls += 1
        longest = max(row[LENGTH] for row in rows)
        if not any(row[COMMITTED] for row in rows):
            for sent in range(PLAN_SLOTS, longest, PLAN_SLOTS):
                mine = torch.tensor(slots(plan[sent : sent + PLAN_SLOTS]), device=self.device)
                got = self.comm.all_gather_control(mine).reshape(len(rows), -1).tolist()
                self.calls += 1
                rows = [a + b for a, b in zip(rows, got, strict=True)]
        plans = [plan_of(row) for row in rows]
        return plans, [r[:HEAD] for r in rows]

    def _check_rows(self, upto: int) -> None:
        """Check the committed rows at positions ``<= upto``: every rank sent the same."""
        for position, rows in self._rows.due(upto):
            plans = [plan_of(row) for row in rows]
            head = [row[:HEAD] for row in rows]
            same = all(p == plans[0] for p in plans) and len({r[MARKER] for r in head}) == 1
            if not same or any(r[ERROR] or not r[COMMITTED] for r in head):
                self._replay_diverged(plans, head, self.replay.padding(position))

    def _replay_diverged(
        self, plans: list[list[Item]], head: list[list[int]], padding: range
    ) -> NoReturn:
        """Ranks parted from the replayed order ([Note: verified orders]): stand in for the
        ``padding`` (the predicted positions the committed ranks can still issue before they
        see the row; none where every rank is at this exchange), wait for it all, then raise
        the same error everywhere."""
        try:
            message = self._replay_story(plans, head)
            self._stand_in(padding)  # no row falls in a padding: it ends before the next start
            self._rows.drain()
        finally:
            self._stop_replay()
        raise RuntimeError(message)

    def _stand_in(self, positions: range) -> None:
        """Take part in the predicted collectives of ``positions``, changing nothing here."""
        for position in positions:
            entry = self.replay.predicted(position)
            assert entry is not None
            for op, i in entry[1]:
                self.extras.stand_in(op, i)

    def _stop_replay(self) -> None:
        self.replay.off()
        self._sequence.clear()
        self._marker = Op.NOTHING
        self._left = -1

    def _replay_story(self, plans: list[list[Item]], head: list[list[int]]) -> str:
        self._positions = [row[POSITION] for row in head]
        error, self.error = self.error, ""
        return replayed_divergence(
            plans,
            [Op(row[MARKER]) for row in head],
            [row[LEFT] for row in head],
            [r for r, row in enumerate(head) if row[ERROR]],
            self.replay.predicted,
            (self._positions, self.labels),
            (self.comm.rank, error),
        )

    def _check_head(self, rows: list[list[int]]) -> None:
        flagged = [r for r, row in enumerate(rows) if row[ERROR]]
        if flagged:
            error, self.error = self.error, ""
            self.replay.off()
            self._left = -1
            raise RuntimeError(reported_message(flagged, error))
        self._positions = [row[POSITION] for row in rows]
        # Where every rank starts some work and the kinds differ (one evaluates while another
        # trains), that is the story.
        markers = [Op(row[MARKER]) for row in rows]
        if Op.NOTHING not in markers and len(set(markers)) > 1:
            self._diverged([(m, -1) for m in markers])

    def _diverged(self, seen: list[Item]) -> NoReturn:
        self._stop_replay()
        raise RuntimeError(divergence_message(seen, self._positions, self.labels))
