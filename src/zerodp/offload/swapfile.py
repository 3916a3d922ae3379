"""``SwapFile``: one rank's file of one tensor group on the NVMe tier, and aligned host buffers.

[Note: swap files]
Each file holds one tensor group (the fp32 masters, or one optimizer state such as Adam's
``exp_avg``) of every chunk this rank steps, each chunk at an offset aligned to ``ALIGN`` bytes
and padded to a multiple of it, so every transfer is one large aligned sequential ``pread`` /
``pwrite``. The file is opened with ``O_DIRECT`` where the filesystem allows it (the page cache
would otherwise hold a second copy of what the tier exists to keep out of host memory; tmpfs
and some others refuse it, and then plain buffered I/O is used), created ``0600`` with
``O_EXCL`` under a name no other run uses, and unlinked at once: it is private to this process,
and the kernel frees its blocks when the process exits, even if it is killed. Its full size is
reserved when it is created (``posix_fallocate``), so a full disk is an ``OffloadDiskFull`` at
that moment, naming the directory and the bytes, never a short write in the middle of a step.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import uuid

import torch

from zerodp.streams import Streams

ALIGN = 4096  # the logical block size O_DIRECT needs on common NVMe drives, and the page size


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class OffloadDiskFull(OSError):
    """The NVMe tier's directory has no room for the offloaded state (``errno`` ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


class SwapFile:
    def __init__(self, directory: str, name: str, nbytes: int) -> None:
        self.directory = directory
        self.name = name
        self.nbytes = aligned(nbytes)
        self.bytes_read = 0  # since creation, for the NVMe traffic a run reports
        self.bytes_written = 0
        self._count = threading.Lock()  # reads and writes run on different workers
        path = os.path.join(directory, f"zerodp-{name}-{uuid.uuid4().hex[:12]}.swap")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False  # the filesystem refuses O_DIRECT (tmpfs): buffered I/O
            self.fd = os.open(path, flags, 0o600)
        os.unlink(path)  # private to this process; freed when it exits, however it exits
        try:
            _reserve(self.fd, self.nbytes)
        except OSError as exc:
            os.close(self.fd)
            if exc.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(directory).free
            raise OffloadDiskFull(
                f"offload to NVMe: {directory!r} has no room for {name} ({self.nbytes} bytes; "
                f"{free} free): free space there or set ZeroConfig.offload.path to a larger "
                "disk (nothing was written; the last checkpoint is unaffected)",
            ) from exc

    def write(self, offset: int, buf: torch.Tensor) -> None:
        """``buf``: an aligned uint8 host tensor (``aligned_empty``) of a multiple of ALIGN."""
        view = _bytes_of(buf)
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        with self._count:
            self.bytes_written += done

    def read(self, offset: int, buf: torch.Tensor) -> None:
        view = _bytes_of(buf)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"offload to NVMe: {self.name} ended at {offset + done}")
            done += n
        with self._count:
            self.bytes_read += done

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def mode(self) -> int:
        return os.fstat(self.fd).st_mode & 0o777


def _reserve(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # no reservation on this filesystem: sparse


def aligned_empty(streams: Streams, nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` (a multiple of ALIGN) starting at an ALIGN boundary,
    as O_DIRECT needs (pinned on CUDA: the same buffer feeds the copies to the device)."""
    raw = streams.host_empty(nbytes + ALIGN, torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw.narrow(0, skip, nbytes)


def _bytes_of(buf: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, for ``os.preadv``/``pwritev`` (no copy)."""
    assert buf.is_contiguous() and buf.device.type == "cpu"
    nbytes = buf.numel() * buf.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
