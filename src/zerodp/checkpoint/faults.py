"""Where tests inject faults into the checkpoint code: each hook is ``None`` in production, and
the code that calls it only compares it with ``None`` then.

A test sets a hook inside the rank process it started (a spawned worker), never through the
environment, and puts it back to ``None`` afterwards::

    from zerodp.checkpoint import faults

    faults.hooks.writing_rank_file = kill_halfway
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class RankFileHook(Protocol):
    def __call__(self, rank: int, index: int, count: int, flush: Callable[[], None]) -> None:
        """Called before this rank writes tensor ``index`` of the ``count`` in its file;
        ``flush`` pushes the bytes written so far to the OS (as a killed process leaves them)."""


@dataclass
class FaultHooks:
    writing_rank_file: RankFileHook | None = None


hooks = FaultHooks()
