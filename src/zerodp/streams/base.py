"""The contract every stream implementation follows.

[Note: streams]
A *stream* runs submitted work in submission order, possibly while the caller goes on; the
*event* a submission returns completes when that work has. The rules code must follow, on any
device:

- work is complete only once its event is: read what ``submit(fn)`` wrote, or reuse a buffer
  it read, after ``event.wait()`` (host) or after ``other.wait(event)`` on the stream that does
  the reading (ordering without blocking the host);
- ``fn`` runs exactly once, on the stream; what it returns is ``event.result()`` (after the
  wait), and an exception it raises is raised again by ``wait``/``result`` on the caller's
  thread, wrapped in ``StreamError`` naming the stream, and by every later submission's event
  on that stream (work queued after a failure is not run: it may depend on what failed);
- tensors used by ``fn`` that the caller might free before the event completes are passed as
  ``uses`` (CUDA: ``record_stream``, so the caching allocator does not hand their memory to
  other work too early; CPU: kept referenced until the work ran).

On CUDA ``fn`` runs on the host at once and only its kernels are queued on the side stream; on
CPU ``fn`` runs in the stream's own worker thread (torch's CPU kernels release the GIL, so the
work overlaps the caller's; a *host* worker, ``Streams.host``, is such a thread on every device,
for host work that must not hold up the caller). Code correct under the CPU semantics, where
even the host side of ``fn`` is deferred, is correct under CUDA's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class StreamError(RuntimeError):
    """Work submitted to a stream raised; the original exception is its ``__cause__``."""


class Event(Protocol):
    def wait(self) -> None:
        """Block the host until the work completed (raises ``StreamError`` if it failed)."""

    def done(self) -> bool:
        """Whether the work completed, without blocking."""

    def result(self) -> Any:
        """``wait``, then what the submitted function returned."""


class Stream(Protocol):
    name: str

    def submit(self, fn: Callable[[], Any], uses: Sequence[torch.Tensor] = ()) -> Event:
        """Run ``fn`` on this stream after everything submitted before; its event."""

    def wait(self, event: Event) -> None:
        """Work submitted to this stream from now on starts after ``event`` completed (the
        host does not block on CUDA)."""

    def synchronize(self) -> None:
        """Block the host until everything submitted so far completed."""


class Streams(Protocol):
    """The owner: one per engine, for its device."""

    device: torch.device

    @property
    def compute(self) -> Stream:
        """The stream the model computes on (CUDA: the current stream; CPU: the caller's
        thread, where ``submit`` runs ``fn`` at once)."""

    def side(self, name: str) -> Stream:
        """The side stream ``name`` (e.g. ``"d2h"``, ``"h2d"``, ``"optimizer"``), created on
        first use; the same one for the same name."""

    def host(self, name: str) -> Stream:
        """The host worker ``name``: a thread that runs its work in order (on every device:
        work such as a CPU optimizer step must not hold up the caller), created on first use.
        It may wait for any event, a device stream's included."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer for copies to and from the device (CUDA: pinned, so copies are
        asynchronous and at full bandwidth)."""

    def close(self) -> None:
        """Wait for every side stream and release them (CPU: stop the worker threads)."""


class FailedEvent:
    """The event of work that raised on the host (or was not run after an earlier failure)."""

    def __init__(self, error: StreamError) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        raise self.error


def failure(stream: str, exc: Exception) -> StreamError:
    error = StreamError(f"work on stream {stream!r} failed: {exc!r}")
    error.__cause__ = exc
    return error
