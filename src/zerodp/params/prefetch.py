"""Predicting which units run next, from the order they actually ran in.

[Note: prefetch]
While unit k computes, the all-gathers of the next ``depth`` units are in flight. "Next" comes
from the order recorded on the previous pass of the same kind (forward or backward); the first
backward, with nothing recorded yet, uses the reverse of this step's forward. A ``PassOrder``
walks the recorded order with a cursor, so a unit that runs twice in one pass (weight reuse)
finds its second occurrence. A unit that is not where the record says (changed order, a skipped
unit) gets no prediction and is gathered on demand; units prefetched for a prediction that
turned out wrong are released by the schedule before new prefetches are issued, so a wrong
guess costs traffic, never correctness, a hang (every rank guesses from the same record), or
more memory than the bound. ``depth`` 0 disables prefetching.
"""

from __future__ import annotations

from collections import Counter


class PassOrder:
    """The order units ran in during one kind of pass, recorded to predict the next one."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.last: list[int] = []  # the order of the previous completed pass
        self.current: list[int] = []  # the pass in progress
        self._cursor = 0

    def begin(self, guess: list[int] | None = None) -> None:
        """A pass starts; ``guess`` is used when nothing was recorded yet."""
        if not self.last and guess:
            self.last = list(guess)
        self.current = []
        self._cursor = 0

    def visit(self, unit: int) -> list[int]:
        """Record that ``unit`` starts now; return the units expected after it (at most
        ``depth``, without repeats or ``unit`` itself)."""
        self.current.append(unit)
        pos = _find(self.last, unit, self._cursor)
        if pos is None:
            return []
        self._cursor = pos + 1
        out: list[int] = []
        for nxt in self.last[pos + 1 :]:
            if len(out) == self.depth:
                break
            if nxt != unit and nxt not in out:
                out.append(nxt)
        return out

    def tail(self, count: int, skip: int) -> set[int]:
        """The last ``count`` units of the recorded order, but ``skip`` (the root); none before
        a unit that ran more than once (it may be needed again before the backward)."""
        runs = Counter(self.last)
        out: set[int] = set()
        for unit in reversed(self.last):
            if len(out) == count:
                break
            if unit == skip:
                continue
            if runs[unit] > 1:
                break
            out.add(unit)
        return out

    def end(self) -> None:
        """The pass finished: its order predicts the next one."""
        if self.current:
            self.last = self.current
        self.current = []
        self._cursor = 0


def _find(order: list[int], unit: int, start: int) -> int | None:
    for i in range(start, len(order)):
        if order[i] == unit:
            return i
    for i in range(min(start, len(order))):
        if order[i] == unit:
            return i
    return None
