"""Every allocation torch's allocator makes while a block of code runs, with its size and the op
that made it: how ``benchmarks/bench_alloc.py`` and ``tests/dist/test_alloc.py`` show that a
steady-state step allocates no model-sized tensor (ZeRO-R's contiguous buffers).

The mechanism is ``torch.profiler.profile(profile_memory=True)``: the allocator reports every
allocation and free to the profiler, which keeps them as ``Allocation`` events in its event tree
(``FunctionEvent`` lists only keep allocations made outside any op, so the tree is read instead).
Allocations on the threads the profiler follows are included: the calling thread (CPU backward
runs there), and gloo's worker threads, which run collectives under the caller's thread-local
profiler state (checked: a flat buffer allocated inside an async gloo ``all_gather`` is
recorded, on the worker's thread id). Frees are matched to allocations of the same window by
address, which gives the window's peak of live bytes it allocated itself (``peak_live``) and what
it allocated and left alive (``retained``); frees of older blocks are not reported by torch.

``with trace.phase("backward"): ...`` inside the window names the allocations made meanwhile (on
any thread: phases are told apart by time, so a gloo worker's allocation lands in the phase that
was running when it happened); allocations outside every phase have phase ``None``.

A window must not end while a collective it launched is still in flight: torch's profiler
crashes the process (SIGSEGV in ``stop_trace``, seen in CI) when a gloo worker thread reports an
allocation while the profiler stops. ``step`` therefore takes ``settle``, which waits for what
the step left in flight (stages 1-2: ``opt.wait_params``, the deferred parameter gather).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Allocation:
    """One allocation: bytes, the op that made it (``None`` outside any op), the thread, the
    allocator's device type and the ``AllocationTrace.phase`` it happened in."""

    nbytes: int
    op: str | None
    thread: int
    device: str
    phase: str | None = None


_PHASE_PREFIX = "alloc_trace::"


class AllocationTrace:
    """``with AllocationTrace() as trace: ...`` then ``trace.allocations`` (in time order).

    ``devices`` filters by allocator device type (``"cpu"`` by default; ``None`` keeps all)."""

    def __init__(self, devices: Sequence[str] | None = ("cpu",)) -> None:
        self.devices = None if devices is None else tuple(devices)
        self.allocations: list[Allocation] = []
        self.peak_live = 0  # most bytes allocated inside the window and alive at once
        self.retained = 0  # bytes allocated inside the window still alive at its end
        self._prof: Any = None

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.allocations, self.peak_live, self.retained = _allocations(prof, self.devices)

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """Mark a phase of the traced code (see the module docstring)."""
        from torch.profiler import record_function

        return record_function(_PHASE_PREFIX + name)

    def step(
        self,
        zero_grad: Callable[[], Any],
        forward: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], Any],
        step: Callable[[], Any],
        settle: Callable[[], Any] | None = None,
    ) -> None:
        """One training step, each of its four phases traced under its name; ``forward``
        returns the loss that ``backward`` takes. ``settle`` (in the step phase) waits for the
        collectives the step left in flight (see the module docstring)."""
        with self.phase("zero_grad"):
            zero_grad()
        with self.phase("forward"):
            loss = forward()
        with self.phase("backward"):
            backward(loss)
        with self.phase("step"):
            step()
            if settle is not None:
                settle()

    @property
    def sizes(self) -> list[int]:
        return [a.nbytes for a in self.allocations]

    def in_phase(self, name: str | None) -> list[Allocation]:
        return [a for a in self.allocations if a.phase == name]


def _allocations(prof: Any, devices: tuple[str, ...] | None) -> tuple[list[Allocation], int, int]:
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int, Allocation | None]] = []  # (time, ptr, size, alloc)
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    phases = sorted(
        (n.start_time_ns, n.end_time_ns, n.name[len(_PHASE_PREFIX) :])
        for n in nodes
        if n.tag == _EventType.TorchOp and n.name.startswith(_PHASE_PREFIX)
    )
    for node in nodes:
        if node.tag != _EventType.Allocation:
            continue
        fields = node.extra_fields
        device = str(fields.device.type)
        if devices is not None and device not in devices:
            continue
        size = int(fields.alloc_size)
        alloc = None
        if size > 0:
            parent = node.parent
            op = parent.name if parent is not None else None
            t = node.start_time_ns
            phase = next((name for lo, hi, name in phases if lo <= t <= hi), None)
            alloc = Allocation(size, op, node.start_tid, device, phase)
        events.append((node.start_time_ns, int(fields.ptr), size, alloc))
    events.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    now = peak = 0
    out: list[Allocation] = []
    for _, ptr, size, alloc in events:
        if alloc is not None:
            out.append(alloc)
            live[ptr] = size
            now += size
            peak = max(peak, now)
        else:
            now -= live.pop(ptr, 0)  # a block from before the window: not ours
    return out, peak, now


def _walk(nodes: Sequence[Any]) -> Iterator[Any]:
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def classify(
    allocations: Sequence[Allocation], thresholds: Mapping[str, int]
) -> dict[str, dict[str, int]]:
    """``{"all": {count, bytes, largest}, name: {count, bytes}}`` where ``name``'s row counts the
    allocations of at least ``thresholds[name]`` bytes."""
    sizes = [a.nbytes for a in allocations]
    out = {"all": {"count": len(sizes), "bytes": sum(sizes), "largest": max(sizes, default=0)}}
    for name, limit in thresholds.items():
        big = [s for s in sizes if s >= limit]
        out[name] = {"count": len(big), "bytes": sum(big)}
    return out


def largest_by_op(allocations: Sequence[Allocation], top: int = 5) -> list[tuple[str, int, int]]:
    """The ``top`` ops by largest single allocation: ``(op, largest bytes, count)``."""
    per_op: dict[str, list[int]] = {}
    for a in allocations:
        per_op.setdefault(a.op or "(no op)", []).append(a.nbytes)
    rows = [(op, max(s), len(s)) for op, s in per_op.items()]
    rows.sort(key=lambda r: (-r[1], r[0]))
    return rows[:top]
