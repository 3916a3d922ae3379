"""The row every rank sends in a stage-3 order exchange (order.py): a head of fixed columns,
then ``PLAN_SLOTS`` items of the plan (an op and an index each; more rows only where a plan is
longer, replay.py). Every rank's row has the same shape, so any two exchanges pair."""

from __future__ import annotations

from zerodp.comm import STEP_PHASES, Communicator
from zerodp.params.order_story import Item, Op
from zerodp.params.replay import PLAN_SLOTS

# The head's columns.
ERROR = 0  # 1: this rank has a problem of its own to report (``OrderCheck.error``)
MARKER = 1  # what this rank starts (``OrderCheck.mark``): an ``Op`` value
POSITION = 2  # steps completed, doubled, plus one inside a step (``step_position``)
BLOCKED = 3  # 1: this rank cannot go on before its plan is agreed
BACKWARDS = 4  # backward passes begun
LENGTH = 5  # items in the whole plan
COMMITTED = 6  # 1: sent without waiting, as predicted ([Note: verified orders])
LEFT = 7  # the replayed position where this rank left a block it promised, or -1
HEAD = 8


def slots(part: list[Item]) -> list[int]:
    """``PLAN_SLOTS`` items of a plan as row columns, padded with ``NOTHING``."""
    part = part + [(Op.NOTHING, -1)] * (PLAN_SLOTS - len(part))
    return [v for op, i in part for v in (int(op), i)]


def plan_of(row: list[int]) -> list[Item]:
    """The plan of an exchanged row (as far as it was sent)."""
    length = min(row[LENGTH], (len(row) - HEAD) // 2)
    return [(Op(row[k]), row[k + 1]) for k in range(HEAD, HEAD + 2 * length, 2)]


def step_position(comm: Communicator) -> int:
    """The ``POSITION`` column: steps completed, doubled, plus one inside a step; equal on every
    rank of a correct program at every exchange."""
    progress = comm.progress
    return 2 * progress.step + int(progress.phase in STEP_PHASES)
