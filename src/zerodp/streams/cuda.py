"""Streams on a CUDA device: ``torch.cuda.Stream`` and ``torch.cuda.Event``, the only place in
zerodp that creates them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerodp.streams.base import Event, FailedEvent, StreamError, failure
from zerodp.streams.cpu import Workers, WorkerStream


class CudaEvent:
    def __init__(self, event: torch.cuda.Event, value: Any, stream: str) -> None:
        self.raw = event
        self._value = value
        self._stream = stream

    def wait(self) -> None:
        self.raw.synchronize()

    def done(self) -> bool:
        return bool(self.raw.query())

    def result(self) -> Any:
        self.wait()
        return self._value


class CudaStream:
    def __init__(self, name: str, stream: torch.cuda.Stream) -> None:
        self.name = name
        self.raw = stream
        self._failed: StreamError | None = None

    def submit(self, fn: Callable[[], Any], uses: Sequence[torch.Tensor] = ()) -> Event:
        if self._failed is not None:
            return FailedEvent(self._failed)
        try:
            with torch.cuda.stream(self.raw):
                value = fn()
        except Exception as exc:  # the host side failed: raised by the event, as on CPU
            self._failed = failure(self.name, exc)
            return FailedEvent(self._failed)
        for t in uses:
            t.record_stream(self.raw)
        event = torch.cuda.Event()
        event.record(self.raw)
        return CudaEvent(event, value, self.name)

    def wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.raw.wait_event(event.raw)
        else:  # an event of another kind (a host-side one): block until it completed
            event.wait()

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sides: dict[str, CudaStream] = {}
        self._hosts = Workers()

    @property
    def compute(self) -> CudaStream:
        return CudaStream("compute", torch.cuda.current_stream(self.device))

    def side(self, name: str) -> CudaStream:
        stream = self._sides.get(name)
        if stream is None:
            stream = self._sides[name] = CudaStream(name, torch.cuda.Stream(self.device))
        return stream

    def host(self, name: str) -> WorkerStream:
        return self._hosts.get(name)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def close(self) -> None:
        self._hosts.close()  # first: host work may still queue copies on the side streams
        for stream in self._sides.values():
            stream.synchronize()
        self._sides.clear()
