"""Streams on the CPU: each side stream is one worker thread running its work in order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerodp.streams.base import Event, StreamError, failure


class CpuEvent:
    def __init__(self, future: Future[Any], stream: str) -> None:
        self._future = future
        self._stream = stream

    def wait(self) -> None:
        error = self._future.exception()
        if error is None:
            return
        if isinstance(error, StreamError):
            raise error
        assert isinstance(error, Exception)
        raise failure(self._stream, error) from error

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        self.wait()
        return self._future.result()


def _completed(value: Any, stream: str) -> CpuEvent:
    future: Future[Any] = Future()
    future.set_result(value)
    return CpuEvent(future, stream)


class InlineStream:
    """The caller's own thread: work runs at once (the CPU's compute stream)."""

    name = "compute"

    def submit(self, fn: Callable[[], Any], uses: Sequence[torch.Tensor] = ()) -> Event:
        future: Future[Any] = Future()
        try:
            future.set_result(fn())
        except Exception as exc:  # raised to the caller by the event, as on a side stream
            future.set_exception(exc)
        return CpuEvent(future, self.name)

    def wait(self, event: Event) -> None:
        event.wait()

    def synchronize(self) -> None:
        pass


class WorkerStream:
    """One worker thread; see [Note: streams] for what a failure does to later work."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zerodp-{name}")
        self._failed: StreamError | None = None
        self._lock = threading.Lock()
        self._last: CpuEvent = _completed(None, name)

    def submit(self, fn: Callable[[], Any], uses: Sequence[torch.Tensor] = ()) -> Event:
        # ``uses`` kept alive until the work ran, and no longer: the executor's worker holds
        # its work item (so ``run`` and what ``run`` refers to) until after the waiter woke, so
        # ``run`` empties ``box`` first. Otherwise a worker descheduled in that gap keeps the
        # last work's tensors alive past its event, which a caller that frees them relies on.
        box: list[Any] = [fn, tuple(uses)]

        def run() -> Any:
            work, kept = box
            box.clear()
            try:
                if self._failed is not None:
                    raise self._failed
                try:
                    return work()
                except Exception as exc:
                    self._failed = failure(self.name, exc)
                    raise self._failed from exc
            finally:  # a raised error's traceback keeps this frame: not its tensors
                del work, kept

        with self._lock:
            event = CpuEvent(self._pool.submit(run), self.name)
            self._last = event
        return event

    def wait(self, event: Event) -> None:
        # The worker blocks on the event before later work; a failure of that work poisons
        # this stream too, since what follows may depend on it.
        self.submit(event.wait)

    def synchronize(self) -> None:
        self._last.wait()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CpuStreams:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._compute = InlineStream()
        self._sides = Workers()  # on the CPU a side stream is a worker thread too
        self._hosts = Workers()

    @property
    def compute(self) -> InlineStream:
        return self._compute

    def side(self, name: str) -> WorkerStream:
        return self._sides.get(name)

    def host(self, name: str) -> WorkerStream:
        return self._hosts.get(name)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def close(self) -> None:
        self._sides.close()
        self._hosts.close()


class Workers:
    """Worker threads by name, created on first use: the CPU's side streams, and the host
    workers of both implementations."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerStream] = {}

    def get(self, name: str) -> WorkerStream:
        worker = self._workers.get(name)
        if worker is None:
            worker = self._workers[name] = WorkerStream(name)
        return worker

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()
