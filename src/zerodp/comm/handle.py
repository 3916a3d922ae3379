"""What an asynchronous collective returns (``Communicator``): wait for it when the result is
needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from zerodp.comm.watchdog import Arrival


class Waiter(Protocol):
    """What waits for a handle's works through the watchdog (the ``Communicator``)."""

    def wait_works(self, works: list[Any], arrival: Arrival) -> None: ...


class Handle:
    """In-flight collective(s), plus a local action to run once they finished (e.g. copying a
    received chunk into place). ``wait`` is idempotent; it waits through the watchdog ([Note:
    watchdog]), so a late or failed rank raises ``CollectiveError`` instead of hanging."""

    __slots__ = ("_after", "_arrival", "_comm", "_works")

    def __init__(
        self,
        work: Any,
        after: Callable[[], Any] | None = None,
        comm: Waiter | None = None,
        arrival: Arrival | None = None,
    ) -> None:
        self._works: list[Any] = work if isinstance(work, list) else [] if work is None else [work]
        self._after = after
        self._comm = comm
        self._arrival = arrival

    def wait(self) -> None:
        if self._works:
            if self._comm is not None and self._arrival is not None:
                self._comm.wait_works(self._works, self._arrival)
            else:
                for work in self._works:
                    work.wait()
            self._works = []
        if self._after is not None:
            after, self._after = self._after, None
            after()

    @property
    def done(self) -> bool:
        return not self._works and self._after is None
