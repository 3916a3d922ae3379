"""How much memory a rank uses on its device, measured: one interface, chosen by device.

[Note: memory meters]
A rank's memory is where its tensors live: host memory on a CPU device, the GPU's memory on a
CUDA device. So the bench and ``zerodp train`` read it through a ``MemoryMeter`` chosen by the
device (``meter_for``), and every table and figure says which one it read (``source``):

- ``RssMeter`` (CPU): the process's resident set size, ``/proc/self/statm``; its peak is
  Linux's ``VmHWM``, which writing ``5`` to ``/proc/self/clear_refs`` resets to the current RSS
  (elsewhere, or where that file is not writable, the peak is the lifetime peak, and
  ``reset_peak`` says so by returning False). RSS also counts the runtime (torch, Python, the
  process group) and what glibc keeps after a free: the baseline before the model is built is
  reported apart.
- ``CudaMeter`` (CUDA): torch's caching allocator, ``memory_allocated`` (bytes in tensors) and
  ``max_memory_allocated`` since ``reset_peak_memory_stats``; ``reserved`` is what it holds
  from the driver (allocated + cached free blocks). Host RSS says nothing about GPU memory.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Protocol

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryMeter(Protocol):
    source: str
    """What is measured, for tables and figures: ``"RSS"`` or ``"CUDA allocated"``."""

    def current(self) -> int | None:
        """Bytes in use now (``None`` where it cannot be read)."""

    def peak(self) -> int | None:
        """The most bytes in use since the last ``reset_peak``."""

    def reset_peak(self) -> bool:
        """Start a new peak from now; False where only a lifetime peak exists."""

    def reserved(self) -> int | None:
        """Bytes the allocator holds beyond ``current`` included (CUDA); ``None`` on CPU."""


def meter_for(device: torch.device) -> MemoryMeter:
    """The meter of a rank whose tensors live on ``device`` (see the note)."""
    if device.type == "cuda":
        return CudaMeter(device)
    return RssMeter()


class RssMeter:
    source = "RSS"

    def current(self) -> int | None:
        return current_rss()

    def peak(self) -> int | None:
        return peak_rss()

    def reset_peak(self) -> bool:
        return reset_peak_rss()

    def reserved(self) -> int | None:
        return None


class CudaMeter:
    source = "CUDA allocated"

    def __init__(self, device: torch.device) -> None:
        self.device = device  # nothing touches CUDA before the first reading

    def current(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> bool:
        torch.cuda.reset_peak_memory_stats(self.device)
        return True

    def reserved(self) -> int | None:
        return int(torch.cuda.memory_reserved(self.device))


def current_rss() -> int | None:
    """Resident bytes of this process now (Linux ``/proc/self/statm``), else ``None``."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def lifetime_peak_rss() -> int:
    """``ru_maxrss`` in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_rss() -> int:
    """Peak RSS since the last ``reset_peak_rss`` (Linux ``VmHWM``), else the lifetime peak.

    Not ``ru_maxrss`` after a reset: it is also the maximum with the peaks the kernel saved when
    threads exited (gloo and the autograd engine start and stop threads), which the reset
    leaves alone."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return lifetime_peak_rss()


def reset_peak_rss() -> bool:
    """Set this process's peak RSS back to its current RSS; ``False`` where not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False
