"""Where an offloaded step's time goes, per step: what each host stage was busy with, how long
``step`` blocked, and how long the next forward waited for landings.

[Note: offload timing]
The offloaded step ([Note: offloaded step] in runner.py) runs on worker threads that a
profiler of the main thread does not see (on an H200 its operator table showed only ``step``
blocked for 497 ms). So the pipeline times itself: each host stage (``unpack``, ``optimizer``,
``cast``) adds the wall time of its work on every chunk, from the end of its waits for what the
chunk needs (a stage that waits for the one before it is not charged for that one's time; with
more threads than cores, a stage's time also holds what others took from it), and counts the
chunks; ``blocked`` is what ``step`` waited for the
last unpack (the device gradients are free only then); ``landing`` is what the caller's thread
waited, after ``step`` returned, for buckets' host work before reading them (the next forward,
or the next step's start). A step's record is complete when the next step starts (its landings
are all waited by then): ``OffloadStep.timing`` is the last complete one. Not timed: device
copies (on CUDA they run on side streams, and an event per chunk would cost more than it
tells) and the NVMe tiers' reads and writes on their own workers; what they hold up shows in
``blocked`` or ``landing`` only where the caller waits for them there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("unpack", "optimizer", "cast")


class PipelineClock:
    """Busy seconds and chunks per host stage of the current step, plus the caller's waits.
    Workers add from their own threads, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = _empty()
        self.last: dict[str, float] | None = None  # the last complete step's record

    @contextmanager
    def working(self, stage: str) -> Iterator[None]:
        """A worker's work on one chunk, after it waited for what the chunk needs (so a stage
        that waits for the one before it is not charged for that one's time)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start, chunks=1)

    def add(self, key: str, seconds: float, chunks: int = 0) -> None:
        with self._lock:
            self._current[key] += seconds
            if chunks:
                self._current[f"{key}_chunks"] += chunks

    def next_step(self) -> None:
        """A step starts: the one before it is complete (landings included) and kept as
        ``last``, unless nothing ran in it."""
        with self._lock:
            done, self._current = self._current, _empty()
        if done["unpack_chunks"]:  # a step ran (not only waits left by a runner rebuilt)
            self.last = done


def _empty() -> dict[str, float]:
    keys = [*STAGES, *(f"{s}_chunks" for s in STAGES), "blocked", "landing"]
    return dict.fromkeys(keys, 0.0)
