"""Which stream implementation a device gets."""

from __future__ import annotations

import torch

from zerodp.streams.base import Streams
from zerodp.streams.cpu import CpuStreams
from zerodp.streams.cuda import CudaStreams


def make_streams(device: torch.device | str) -> Streams:
    """``CudaStreams`` for a CUDA device, ``CpuStreams`` for anything else (CPU, and devices
    without streams: their work runs in order on worker threads)."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaStreams(device)
    return CpuStreams()
