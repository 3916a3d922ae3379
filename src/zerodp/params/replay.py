"""Order checks that do not block: the order of the last step, replayed and verified later.

[Note: verified orders]
The blocking exchange of order.py makes every rank wait for the slowest at every check (2.7 to
5.6 % of a stage-3 step on the CPU bench). Most models run the same collectives in the same
order step after step, so once a whole step was agreed unanimously (every exchange of it had
the same plan and marker on every rank: nothing merged), its sequence of plans (*entries*)
becomes the *prediction* for the next step. A rank whose next plan is the predicted one sends
its exchange row without waiting for it (*committed*) and issues the collectives at once; the
row is checked ``WINDOW`` exchanges later, when it has long completed. Every rank that follows
the prediction issues the same collectives in the same order, so nothing can hang or mix data
before a difference is seen:

- A rank whose plan is not the predicted one (or that has an error to report) first checks
  every older row, then exchanges its row blocking. Where no row there is committed (every rank
  left the prediction at that point: another accumulation count, a checkpoint), the exchange
  decides as it always did, and the rest of the step is recorded afresh.
- Where some rank committed, those ranks already issue the predicted collectives: the rank
  *stands in* for them (all-gathers into scratch, reduce-scatters of zeros: no state of its
  own changes) and the ranks have diverged. Every rank that sees it, the first at once and the
  others when they check that row, issues the predicted exchanges and collectives up to
  ``padding_end`` (no committed rank can have gone further without checking the row), waits
  for all of them and raises the divergence error: the same on every rank, with nothing left
  in flight. The gradients of that step are incomplete on every rank (zero_grad before going
  on).

Limits: the bound counts the checked collectives only, so another collective on the same
process group inside the window (a loss all-reduced between forward and backward, SyncBatchNorm,
``generate(synced_gpus=True)``) can still pair with a stand-in; the blocking exchange had the
same exposure one collective earlier. A rank whose program ends (no further exchange) within
``WINDOW`` exchanges of a divergence leaves the rank that parted waiting in its padding until
the watchdog names it.

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

WINDOW = 4
"""Exchanges a committed row may lag behind before it is checked (any value >= 1 is correct;
a larger one blocks less often and pads more on a divergence)."""

PLAN_SLOTS = 4
"""Collectives agreed on per exchange row (``OrderCheck.approve``); every row has this shape."""

MAX_ENTRIES = 1 << 16
"""A step with more exchanges than this (inference without steps) is not recorded."""

Entry = tuple[int, tuple[Item, ...]]  # marker, plan

_BARRIER_OPS = (Op.STEP, Op.BUFFERS, Op.CHECKPOINT, Op.SKIPS)


def is_barrier(plan: tuple[Item, ...]) -> bool:
    """Always exchanged blocking (see the note)."""
    return len(plan) > PLAN_SLOTS or any(op in _BARRIER_OPS for op, _ in plan)


class Replay:
    """The recorded and predicted entries of steps (see the note): bookkeeping only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.position = 0  # exchanges so far in this step
        self._prediction: list[Entry] | None = None
        self._recording: list[Entry] = []
        self._unanimous = True

    def expects(self, entry: Entry) -> bool:
        """Whether ``entry`` may be committed: predicted here, and no barrier."""
        return self.predicted(self.position) == entry and not is_barrier(entry[1])

    def predicted(self, position: int) -> Entry | None:
        p = self._prediction
        return p[position] if p is not None and position < len(p) else None

    def advance(self, entry: Entry) -> None:
        """Every rank agreed on ``entry`` (committed, or exchanged with the same plan)."""
        if self.predicted(self.position) != entry:
            self._prediction = None  # left on every rank alike: the rest is exchanged
        if len(self._recording) < MAX_ENTRIES:
            self._recording.append(entry)
        else:
            self._unanimous = False
        self.position += 1

    def padding_end(self, diverged: int) -> int:
        """The last position every rank issues after a divergence at ``diverged``: a committed
        rank checks row ``p`` before it sends row ``p + WINDOW``; never a barrier."""
        end = diverged + WINDOW - 1
        for p in range(diverged + 1, end + 1):
            entry = self.predicted(p)
            if entry is None or is_barrier(entry[1]):
                return p - 1
        return end

    def end_step(self) -> None:
        """The step's exchange was agreed: a unanimous step predicts the next one."""
        keep = self.enabled and self._unanimous
        self._prediction = self._recording if keep else None
        self._recording, self._unanimous, self.position = [], True, 0

    def off(self) -> None:
        """Plans were merged or ranks diverged: exchange blocking from now on."""
        self.enabled = False
        self._prediction = None
        self._unanimous = False


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
