"""``Landing``: which buckets' offloaded updates are not back on the device yet.

The offloaded step ([Note: offloaded step] in runner.py) returns before the CPU has stepped
every bucket. For each bucket it leaves here the event of the host work that steps it; that
work's result is the event of the copy back to the device, or of the write to the parameters'
file (``offload.params="nvme"``), or None where the host work itself wrote the parameters
(``offload.params="cpu"``). Whoever reads a bucket's parameters
first waits for its landing: the stage 1-2 all-gather of the bucket (``DeferredGather``), the
stage 3 gather of a unit's shards (``Gatherer``), and ``wait_all`` before anything that reads
parameters or masters outside the step's order (the next step, checkpoints, reads through the
model). Only the caller's thread uses it.
"""

from __future__ import annotations

import time

from zerodp.streams import Event, Streams


class Landing:
    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        # (segment, bucket) -> the host work of each of its chunks ([Note: offload chunks])
        self._pending: dict[tuple[int, int], list[Event]] = {}
        self._waited = 0.0  # seconds blocked on host work since ``take_waited``

    def expect(self, seg: int, bucket: int, stepped: Event) -> None:
        """``stepped``: the host work updating a chunk of this bucket; its result is the copy's
        event (see the module docstring)."""
        self._pending.setdefault((seg, bucket), []).append(stepped)

    def wait(self, seg: int, bucket: int) -> None:
        """Work on the compute stream from now on sees the bucket's updated parameters."""
        for stepped in self._pending.get((seg, bucket), []):
            # Raises if the host work failed, and again at every later wait: the bucket was not
            # updated, and nothing may read it as if it had been.
            start = time.perf_counter()
            try:
                copied = stepped.result()
                if copied is not None:  # a file write blocks here; a device copy does not
                    self.streams.compute.wait(copied)
            finally:
                self._waited += time.perf_counter() - start
        self._pending.pop((seg, bucket), None)

    def wait_segment(self, seg: int) -> None:
        for s, b in [key for key in self._pending if key[0] == seg]:
            self.wait(s, b)

    def pending_events(self, seg: int) -> list[Event]:
        """The host work of the segment's updates not waited for yet (a worker that reads what
        they write waits for them itself: ``event.result()``, then that event if not None)."""
        return [e for (s, _), events in self._pending.items() if s == seg for e in events]

    def wait_all(self) -> None:
        for s, b in list(self._pending):
            self.wait(s, b)

    def abandon(self) -> None:
        """Forget every bucket (the engine is removed after a failure that was raised): no
        reader waits for them any more."""
        self._pending.clear()

    def take_waited(self) -> float:
        """Seconds the caller blocked on buckets' host work since the last call ([Note:
        offload timing] in timing.py)."""
        waited, self._waited = self._waited, 0.0
        return waited

    @property
    def pending(self) -> int:
        return len(self._pending)
