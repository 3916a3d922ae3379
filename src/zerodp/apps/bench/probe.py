"""Measuring what a rank holds: memory by phase (through the device's ``MemoryMeter``: RSS on
CPU, the CUDA allocator on a GPU, [Note: memory meters] in zerodp/memory/meter.py), glibc's
heap figures on CPU, and bytes of tensors by storage.

Bytes of tensors are counted per *storage*, once: a parameter that is a view into a flat buffer
counts the buffer, and a buffer already counted in one category is not counted again in the
next. A DTensor counts its local shard's storage.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterable
from typing import Any

import torch

from zerodp.memory import MemoryMeter, local_tensor, storage_key

_MALLINFO2_FIELDS: tuple[str, ...] = ("arena", "ordblks", "smblks", "hblks", "hblkhd")
_MALLINFO2_FIELDS += ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]  # glibc's struct


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Any:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_stats() -> dict[str, int] | None:
    """glibc's account of the C heap (where CPU tensors live): ``heap_used`` bytes handed out
    (arena chunks in use + mmapped blocks) and ``heap_free`` bytes freed but kept by the
    allocator (resident if they were touched): RSS that no tensor holds. ``None`` elsewhere."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return {"heap_used": int(info.uordblks + info.hblkhd), "heap_free": int(info.fordblks)}


class PhaseProbe:
    """Memory at the end of each phase of a step, and the peak within it, as the device's
    ``MemoryMeter`` reads it ([Note: memory meters] in zerodp/memory/meter.py: RSS on CPU, the
    CUDA allocator on a GPU).

    Create it when set-up is done: it first reads the peak so far (model build and wrapping,
    ``setup_peak``), then checks that the peak can be reset."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter
        self.setup_peak = meter.peak()
        self.resettable = meter.reset_peak()

    def begin(self) -> None:
        """A phase starts: its peak counts from here."""
        if self.resettable:
            self.meter.reset_peak()

    def end(self) -> dict[str, int | None]:
        """A phase ended: bytes now and the peak during the phase; on CPU glibc's heap figures,
        on CUDA the allocator's reserved bytes."""
        out: dict[str, int | None] = {"now": self.meter.current(), "peak": self.meter.peak()}
        reserved = self.meter.reserved()
        if reserved is not None:
            out["reserved"] = reserved
        else:
            out.update(malloc_stats() or {})
        return out


def tensor_bytes(values: Iterable[Any], seen: set[tuple[str, int]], device_type: str) -> int:
    """Bytes of the storages of ``values`` (tensors; anything else is skipped) on devices of
    ``device_type`` (what the bench's meter measures: on CUDA, host-resident offloaded state
    is not in the allocator's figures) not in ``seen``; adds them to ``seen``. A storage of 0
    bytes (a freed FSDP buffer) counts 0."""
    total = 0
    for value in values:
        t = local_tensor(value)
        if t is None or t.device.type != device_type:
            continue
        with contextlib.suppress(RuntimeError):  # a tensor without storage (e.g. sparse)
            key = storage_key(t)
            if key[1] == 0 or key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[Any]:
    """Every value in ``opt.state`` (tensors and scalars; ``tensor_bytes`` keeps the tensors)."""
    return [v for st in opt.state.values() for v in st.values()]
