"""Order checks that do not block: the order of the last step, replayed and verified later.

[Note: verified orders]
The blocking exchange of order.py makes every rank wait for the slowest at every check (2.7 to
5.6 % of a stage-3 step on the CPU bench). Most models run the same collectives in the same
order step after step, so once a whole step was agreed unanimously (every exchange of it had
the same plan and marker on every rank: nothing merged), its sequence of plans (*entries*)
becomes the *prediction* for the next step. The prediction is cut into *blocks* of ``BLOCK``
exchanges (``block_starts``; none spans a barrier). A rank whose plan at a block's start is
the predicted one sends its exchange row without waiting for it (*committed*): it promises the
predicted plans of the whole block, issues their collectives at once and exchanges nothing
else until the block ends. A committed row is checked at the next block's start (or barrier),
before that block's row is sent, when it has long completed. Every rank that keeps the promise
issues the same collectives in the same order, so nothing can hang or mix data before a
difference is seen. One row per block instead of one per exchange: each tiny all-gather costs
the CPU more than its bytes (a gloo worker woken and waited for), and a step of bench25m has
about 20 exchanges.

- A rank whose plan at a block's start is not the predicted one (or that has an error to
  report) first checks every older row, then exchanges its row blocking. Where no row there is
  committed (every rank left the prediction at that point: another accumulation count, a
  checkpoint), the exchange decides as it always did, and the rest of the step is recorded
  afresh.
- A rank whose plan inside a block it promised is not the predicted one (``leave``) stands in
  for the rest of the block (all-gathers into scratch, reduce-scatters of zeros: no state of its
  own changes; these pair with what the others issue), then exchanges blocking with the
  position where it left (``left`` column) and the plan it has there. Where every rank left at
  the same position, the step changed alike everywhere: the exchange decides as it always did
  and the step is exchanged from there on (and recorded, without the stand-ins). Where ranks
  left at different positions, or some left and the others are at a barrier (exchanging too),
  every rank raises at once.
- Where some rank committed the row a rank exchanges against, those ranks already issue the
  predicted collectives: the rank stands in for them and the ranks have diverged. Every rank
  that sees it, the first at once and the others when they check that row, issues the predicted
  collectives of its ``padding`` (no committed rank can have gone further without checking
  the row; a padding never reaches the next row), waits for all of them and raises the
  divergence error: the same on every rank, with nothing left in flight, naming what each rank
  was about to do where the first one left. The gradients of that step are incomplete on every
  rank (zero_grad before going on).

Limits: the bound counts the checked collectives only, so another collective on the same
process group inside a block or a padding (a loss all-reduced between forward and backward,
SyncBatchNorm, ``generate(synced_gpus=True)``) can still pair with a stand-in; the blocking
exchange had the same exposure one collective earlier. A rank's own error (``OrderCheck.error``)
found inside a block it promised is reported where the block ends, at most ``BLOCK`` exchanges
after it was found, still before the step. A rank whose program ends (no further exchange) within
a block or two of a divergence leaves the rank that parted waiting in its padding until the
watchdog names it.

Barriers (the step, the buffer broadcast, checkpoints, the skipped gathers of a backward, plans
longer than one row) always exchange blocking, after every older row is checked; padding stops
before them. A merge turns replay off for good (ranks that run different units: MoE routing),
as does any divergence;
``Stage3.check_unit_order="exchange"`` never replays, for models whose ranks run the same
units for many steps and then differ (they must be merged, not refused).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from zerodp.comm import Handle
from zerodp.params.order_story import Item, Op

BLOCK = 4
"""Replayed exchanges one committed row covers: a rank that commits the first promises the
predicted plans of the next ones, which then exchange nothing (any value >= 1 is correct; a
larger one sends fewer rows and stands in for more collectives when ranks part)."""

PLAN_SLOTS = 4
"""Collectives agreed on per exchange row (``OrderCheck.approve``); every row has this shape."""

MAX_ENTRIES = 1 << 16
"""A step with more exchanges than this (inference without steps) is not recorded."""

Entry = tuple[int, tuple[Item, ...]]  # marker, plan

_BARRIER_OPS = (Op.STEP, Op.BUFFERS, Op.CHECKPOINT, Op.SKIPS)


def is_barrier(plan: tuple[Item, ...]) -> bool:
    """Always exchanged blocking (see the note)."""
    return len(plan) > PLAN_SLOTS or any(op in _BARRIER_OPS for op, _ in plan)


def block_starts(prediction: list[Entry]) -> frozenset[int]:
    """The positions whose row a rank commits: every ``BLOCK``-th exchange of each run of
    exchanges between barriers (the same on every rank: the prediction is)."""
    starts: set[int] = set()
    run = 0
    for position, (_, plan) in enumerate(prediction):
        if is_barrier(plan):
            run = 0
            continue
        if run % BLOCK == 0:
            starts.add(position)
        run += 1
    return frozenset(starts)


class Replay:
    """The recorded and predicted entries of steps (see the note): bookkeeping only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.position = 0  # exchanges so far in this step
        self.promised = 0  # this rank committed to the predicted entries below this position
        self._prediction: list[Entry] | None = None
        self._starts: frozenset[int] = frozenset()
        self._recording: list[Entry] = []
        self._unanimous = True

    def expects(self, entry: Entry) -> bool:
        """Whether ``entry`` is the predicted one here, and no barrier."""
        return self.predicted(self.position) == entry and not is_barrier(entry[1])

    def starts_block(self) -> bool:
        """Whether a rank commits its row here (and so promises the block it starts)."""
        return self._prediction is not None and self.position in self._starts

    def in_block(self) -> bool:
        """Whether this rank promised the predicted entry here (it committed its block)."""
        return self.position < self.promised  # 0 whenever there is no prediction

    def promise(self) -> None:
        """This rank committed the row at this position: it issues the predicted collectives
        up to the next check."""
        self.promised = self.next_check(self.position)

    def predicted(self, position: int) -> Entry | None:
        p = self._prediction
        return p[position] if p is not None and position < len(p) else None

    def next_check(self, position: int) -> int:
        """The first position after ``position`` where a rank that follows the prediction
        checks the rows sent before it: the next block's start or a barrier."""
        p = self._prediction or []
        after = position + 1
        while after < len(p) and after not in self._starts and not is_barrier(p[after][1]):
            after += 1
        return after

    def advance(self, entry: Entry) -> None:
        """Every rank agreed on ``entry`` (committed, or exchanged with the same plan)."""
        if self.predicted(self.position) != entry:
            self.drop()  # left on every rank alike: the rest is exchanged
        if len(self._recording) < MAX_ENTRIES:
            self._recording.append(entry)
        else:
            self._unanimous = False
        self.position += 1

    def leave(self) -> range:
        """This rank's plan is not the one it promised: the positions it stands in for until
        the block ends (their collectives, as the others issue them), after which it exchanges
        blocking. They are not recorded: what follows is what the program does after the
        entries recorded so far, a prediction of the next step if every rank left alike."""
        skipped = range(self.position, self.promised)
        self.position = self.promised
        return skipped

    def padding(self, diverged: int) -> range:
        """What every rank still issues after a divergence found at the row of ``diverged``
        (from this rank's position on): a rank that committed that row checks it at the next
        check, before any collective of its own there."""
        return range(self.position, self.next_check(diverged))

    def drop(self) -> None:
        """Every rank left the prediction alike: exchange blocking for the rest of the step,
        which is recorded as it goes on (see ``leave``). No prediction, no promise."""
        self._prediction = None
        self.promised = 0

    def end_step(self) -> None:
        """The step's exchange was agreed: a unanimous step predicts the next one."""
        keep = self.enabled and self._unanimous
        self._prediction = self._recording if keep else None
        self._starts = block_starts(self._recording) if keep else frozenset()
        self._recording, self._unanimous, self.position, self.promised = [], True, 0, 0

    def off(self) -> None:
        """Plans were merged or ranks diverged: exchange blocking from now on."""
        self.enabled = False
        self._unanimous = False
        self.drop()


class CommittedRows:
    """Exchange rows sent without waiting, checked later in the order they were sent."""

    def __init__(self) -> None:
        self._rows: deque[tuple[int, Handle, torch.Tensor]] = deque()

    def add(self, position: int, handle: Handle, rows: torch.Tensor) -> None:
        self._rows.append((position, handle, rows))

    def due(self, upto: int) -> Iterator[tuple[int, list[list[int]]]]:
        """Wait for the rows at positions ``<= upto`` (oldest first): (position, every rank's
        row)."""
        while self._rows and self._rows[0][0] <= upto:
            position, handle, rows = self._rows.popleft()
            handle.wait()
            yield position, rows.tolist()

    def drain(self) -> None:
        """Wait for every row without looking at it (after a divergence)."""
        while self._rows:
            self._rows.popleft()[1].wait()
