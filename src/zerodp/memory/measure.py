"""Measuring the host-side constants of ``Machine`` on this machine: CPU Adam, host memory
copies, disk bandwidth. Quick (a few seconds at the default sizes) and approximate: the median
of a few repeats after a warm-up. torch is imported only when a measurement runs.

The device's constants (PCIe, FLOP/s, device memory bandwidth) need a CUDA device and are not
measured here.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

MiB = 2**20
_DISK_BLOCK = 8 * MiB  # one write/read call


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured rate, in the unit of the ``Machine`` field it checks (named after it;
    ``cpu_adam_foreach_params_per_s`` is the foreach AdamW, for comparison)."""

    name: str
    value: float
    unit: str
    how: str


def _median_seconds(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu_adam(numel: int = 16 * MiB, repeats: int = 7, *, fused: bool = True) -> Measurement:
    """Parameters per second of ``torch.optim.AdamW(fused=...)`` (``foreach`` when not fused)
    stepping one fp32 tensor of ``numel`` elements with a gradient, on every intra-op thread."""
    import torch

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW([param], lr=1e-3, **kind)  # type: ignore[arg-type]
    seconds = _median_seconds(opt.step, repeats)
    how = (
        f"AdamW({'fused' if fused else 'foreach'}=True), {numel:,} fp32 elements, "
        f"{torch.get_num_threads()} threads, median of {repeats}"
    )
    name = "cpu_adam_params_per_s" if fused else "cpu_adam_foreach_params_per_s"
    return Measurement(name, numel / seconds, "params/s", how)


def measure_memcpy(nbytes: int = 128 * MiB, repeats: int = 5) -> Measurement:
    """Bytes copied per second by ``Tensor.copy_`` between two host buffers."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), repeats)
    threads = torch.get_num_threads()
    how = f"Tensor.copy_ of {nbytes / MiB:g} MiB, {threads} threads, median of {repeats}"
    return Measurement("host_memcpy_bytes_per_s", nbytes / seconds, "B/s", how)


def measure_disk(directory: str | None = None, nbytes: int = 256 * MiB) -> list[Measurement]:
    """Write (then fsync) and read back ``nbytes`` in ``directory`` (the temporary directory by
    default) through the NVMe tier's own ``SwapFile`` ([Note: swap files]): the same aligned
    transfers, ``O_DIRECT`` where the file system allows it, the same reserved, unlinked file.
    Without ``O_DIRECT`` the read follows ``posix_fadvise(DONTNEED)`` so that it comes from the
    disk, not the page cache, as far as the kernel honours it."""
    import torch

    from zerodp.offload.swapfile import ALIGN, SwapFile, aligned_empty
    from zerodp.streams import make_streams

    where = directory or tempfile.gettempdir()
    block = min(_DISK_BLOCK, max(ALIGN, nbytes // ALIGN * ALIGN))
    blocks = max(1, nbytes // block)
    total = block * blocks
    buf = aligned_empty(make_streams(torch.device("cpu")), block)
    buf.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8))  # nothing to compress
    f = SwapFile(where, "disk-probe", total)
    try:
        start = time.perf_counter()
        for i in range(blocks):
            f.write(i * block, buf)
        os.fsync(f.fd)
        write_s = time.perf_counter() - start
        if not f.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for i in range(blocks):
            f.read(i * block, buf)
        read_s = time.perf_counter() - start
        method = "O_DIRECT" if f.direct else "buffered, fsync, fadvise(DONTNEED) before the read"
    finally:
        f.close()
    where = f"{total / MiB:g} MiB in {where}, {method}"
    return [
        Measurement("disk_write_bytes_per_s", total / write_s, "B/s", f"write + fsync, {where}"),
        Measurement("disk_read_bytes_per_s", total / read_s, "B/s", f"read, {where}"),
    ]
