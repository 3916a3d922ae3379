"""The watchdog: a rank that waits too long in a collective, or whose collective fails, raises an
error that says which rank is late or failed, where every rank is, and what to do.

[Note: watchdog] Without it, ranks waiting for a stalled rank (alive, but stuck in a data loader,
a deadlock, ``time.sleep``) block for the whole process-group timeout (30 minutes by default),
and a rank that died leaves the others with gloo's "Connection closed by peer", which names a
port, not a rank. One mechanism covers every collective zerodp issues, because they all go
through ``Communicator``:

- every collective is *launched* asynchronously and *waited* here, with ``Work.wait(timeout)``
  (the same condition variable as a plain ``wait()``, so the common case costs nothing extra);
- each collective gets a sequence number on its group (the same on every rank of a correct
  program) and carries the step and phase the engine last set in ``Progress``;
- a daemon thread publishes, at most every ``interval``, this rank's position (sequence number,
  collective, step, phase, whether it is waiting, any failure) in the process group's store. It
  needs no cooperation from the main thread, so a rank stuck in its own code still reports
  where it is;
- a wait that outlasts ``ZeroConfig.watchdog_s``, or a collective that fails, publishes this
  rank's own state, waits one interval for the others' to be fresh, reads every member's and
  raises ``CollectiveError`` naming the ranks that did not arrive (lower sequence number), the
  rank that failed first (its ``sys.excepthook`` recorded the exception before the process
  died), ranks at different steps, or ranks that issued different collectives;
- a rank that arrives after the others gave up reads their "gave up" records and says that it
  was the late one.

The error is raised on every waiting rank. After it, the process group is in an undefined state
(collectives of the dead or late rank are still pending): end the process, and resume from the
last checkpoint, which is untouched (checkpoints are written to a temporary directory and renamed
only when every rank's file is complete).
"""

from __future__ import annotations

import atexit
import datetime
import json
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NamedTuple

from zerodp.comm.diagnosis import Record, explain, first_line

BETWEEN_STEPS = "between steps"


class CollectiveError(RuntimeError):
    """A collective did not complete: some rank is late, failed, or issued another collective.
    ``late`` and ``failed`` are group ranks."""

    def __init__(self, message: str, late: Sequence[int] = (), failed: int | None = None) -> None:
        super().__init__(message)
        self.late = tuple(late)
        self.failed = failed


class Progress:
    """What this rank is doing, as far as zerodp knows: set by the engine at phase changes,
    read by the publisher thread (plain attribute writes: nothing to lock)."""

    __slots__ = ("phase", "step")

    def __init__(self) -> None:
        self.step = 0  # optimizer steps completed
        self.phase = "initialize"

    def enter(self, phase: str) -> None:
        self.phase = phase

    def __deepcopy__(self, memo: dict[int, Any]) -> Progress:
        return self  # one per process and group, like the Watch holding it


class Arrival(NamedTuple):
    seq: int
    op: str
    step: int
    phase: str


def interval_for(timeout_s: float | None) -> float:
    """How often positions are published: often enough that a rank that waited ``timeout_s``
    reads fresh ones, rarely enough to cost nothing."""
    return 1.0 if timeout_s is None else min(1.0, timeout_s / 10)


class Watch:
    """The position of this rank on one process group, and the waits on it. One per process
    and group (``watch_for``), shared by every ``Communicator`` on that group, so that the
    sequence numbers count every zerodp collective on it."""

    def __init__(self, store: Any, rank: int, members: Sequence[int]) -> None:
        self.store = store
        self.rank = rank
        self.members = tuple(members)  # global ranks, index = group rank
        self.interval_s = 1.0
        self.progress = Progress()
        self.seq = 0
        self.last: Arrival | None = None
        self.waiting: tuple[Arrival, float] | None = None  # and since (time.time())
        self.error: tuple[str, str] | None = None  # (kind, text): "failed" | "gave up" | "error"
        self.late: tuple[int, ...] = ()
        self._failed_at: tuple[int, str] | None = None
        self.changed_at = time.time()
        self._published: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self._prefix = "zerodp/watch/" + "-".join(map(str, self.members[:8])) + f"/{len(members)}/"
        self.publish()
        _PUBLISHER.register(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Watch:
        # copy.deepcopy(model) reaches the engine: a copy shares this process's position
        # (and the store and lock cannot be copied).
        return self

    # -- the main thread -----------------------------------------------------------------------

    def arrive(self, op: str) -> Arrival:
        self.seq += 1
        arrival = Arrival(self.seq, op, self.progress.step, self.progress.phase)
        self.last = arrival
        return arrival

    def use_timeout(self, timeout_s: float | None) -> None:
        self.interval_s = min(self.interval_s, interval_for(timeout_s))

    def wait(self, works: Sequence[Any], arrival: Arrival, timeout: float | None) -> None:
        """Wait for ``works`` (one collective's), at most ``timeout`` seconds in all."""
        start = time.time()
        self.waiting = (arrival, start)
        try:
            for work in works:
                if timeout is None:
                    work.wait()
                else:
                    left = max(timeout - (time.time() - start), 0.001)
                    work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            self.waiting = None
            raise self.diagnose(arrival, time.time() - start, e, timeout) from e
        self.waiting = None
        self.changed_at = time.time()

    def diagnose(
        self, arrival: Arrival, waited: float, cause: BaseException, timeout: float | None
    ) -> CollectiveError:
        """Publish this rank's failure, read everyone's position, say what happened."""
        if isinstance(cause, CollectiveError):
            return cause
        # Work.wait(timeout) may return a hair early by this clock.
        timed_out = timeout is not None and waited >= 0.99 * timeout
        kind = "gave up" if timed_out else "error"  # the cause itself is in this rank's message
        self.error = (kind, f"{arrival.op} #{arrival.seq} after {waited:.1f} s")
        self._failed_at = (self.progress.step, self.progress.phase)
        self.changed_at = time.time()
        self.publish()
        # Others' publishers refresh in that time. A failed collective (a dead peer) needs less:
        # the dying rank wrote its record before its connections closed.
        time.sleep(self.interval_s * (1.5 if timed_out else 0.2))
        records = self.read_all()
        world = len(self.members)
        message, late, failed = explain(
            self.rank, arrival, waited, records, cause, timed_out, timeout, world, self.members
        )
        self.late = tuple(late)
        self.publish()  # a late rank that arrives now reads that it was the one
        return CollectiveError(message, late, failed)

    def record_failure(self, exc: BaseException) -> None:
        """This process is dying of ``exc`` (``sys.excepthook``): say so before gloo's
        connections close, so that the others name this rank and its exception."""
        if self.error is None:
            self.error = ("failed", f"{type(exc).__name__}: {first_line(exc)}")
            self._failed_at = (self.progress.step, self.progress.phase)
        self.publish()

    # -- the store (main thread or publisher) --------------------------------------------------

    def record(self) -> Record:
        waiting = self.waiting
        last = self.last
        # After an error, the place it happened: the exception unwinding the caller's phase
        # must not move this rank's published position.
        step, phase = self._failed_at or (self.progress.step, self.progress.phase)
        return Record(
            seq=last.seq if last else 0,
            op=last.op if last else "",
            step=step,
            phase=phase,
            waiting=waiting is not None,
            since=waiting[1] if waiting else self.changed_at,
            error_kind=self.error[0] if self.error else "",
            error=self.error[1] if self.error else "",
            at=time.time(),
            late=self.late,
        )

    def publish(self) -> None:
        """Write this rank's record if anything but its timestamps changed since the last."""
        record = self.record()
        key = (record.seq, record.step, record.phase, record.waiting, record.error, record.late)
        with self._lock:
            if key == self._published:
                return
            try:
                self.store.set(self._prefix + str(self.rank), json.dumps(record.to_json()))
                self._published = key
            except Exception:  # the store went away with the group: stay quiet
                _PUBLISHER.unregister(self)

    def read_all(self) -> dict[int, Record]:
        out = {}
        with self._lock:
            for r in range(len(self.members)):
                key = self._prefix + str(r)
                try:
                    if self.store.check([key]):
                        out[r] = Record.from_json(json.loads(self.store.get(key)))
                except Exception:  # a rank we cannot read is reported as unknown
                    continue
        return out


class _Publisher:
    """One daemon thread per process publishes every live ``Watch``."""

    def __init__(self) -> None:
        self._watches: weakref.WeakSet[Watch] = weakref.WeakSet()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def register(self, watch: Watch) -> None:
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zerodp-watchdog")
                self._thread.daemon = True
                self._thread.start()
                atexit.register(self.stop)
                _chain_excepthook()

    def unregister(self, watch: Watch) -> None:
        self._watches.discard(watch)

    def watches(self) -> list[Watch]:
        with self._lock:
            return list(self._watches)

    def _run(self) -> None:
        while not self._stop.is_set():
            watches = self.watches()
            for watch in watches:
                watch.publish()
            interval = min((w.interval_s for w in watches), default=1.0)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


_PUBLISHER = _Publisher()


def _chain_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        for watch in _PUBLISHER.watches():
            watch.record_failure(exc)
        previous(kind, exc, tb)

    sys.excepthook = hook


_WATCHES: dict[tuple[int, tuple[int, ...]], tuple[Any, Watch]] = {}


def watch_for(default_group: Any, store: Any, rank: int, members: Sequence[int]) -> Watch:
    """The ``Watch`` of this process on the group of ``members`` (global ranks), created on
    first use. Keyed by the default process group too: a new ``init_process_group`` in the same
    process starts from a new store and new sequence numbers."""
    key = (id(default_group), tuple(members))
    entry = _WATCHES.get(key)
    if entry is None or entry[0] is not default_group:
        entry = (default_group, Watch(store, rank, members))
        _WATCHES[key] = entry
    return entry[1]


__all__ = ["BETWEEN_STEPS", "Arrival", "CollectiveError", "Progress", "Watch", "watch_for"]
