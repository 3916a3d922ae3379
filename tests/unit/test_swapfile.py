"""``SwapFile`` (the NVMe tier's files, [Note: swap files]): aligned round trips, private and
unlinked files, the buffered fallback where O_DIRECT is refused, and a full disk named."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

import zerodp.offload.swapfile as swapfile
from zerodp.offload.swapfile import ALIGN, OffloadDiskFull, SwapFile, aligned, aligned_empty
from zerodp.streams import make_streams


def _buffer(nbytes: int, fill: int) -> torch.Tensor:
    buf = aligned_empty(make_streams(torch.device("cpu")), nbytes)
    assert buf.data_ptr() % ALIGN == 0 and buf.numel() == nbytes
    return buf.fill_(fill)


def _round_trip(f: SwapFile) -> list[int]:
    f.write(0, _buffer(ALIGN, 1))
    f.write(2 * ALIGN, _buffer(2 * ALIGN, 3))
    got = _buffer(3 * ALIGN, 0)
    f.read(0, got)
    return [int(got[i * ALIGN]) for i in range(3)]


def test_aligned_rounds_up_to_whole_blocks() -> None:
    assert [aligned(n) for n in (1, ALIGN, ALIGN + 1)] == [ALIGN, ALIGN, 2 * ALIGN]


def test_a_file_is_reserved_private_and_unlinked(tmp_path: Path) -> None:
    f = SwapFile(str(tmp_path), "rank0-masters", 4 * ALIGN - 5)
    assert f.nbytes == 4 * ALIGN and os.fstat(f.fd).st_size == 4 * ALIGN
    assert f.mode == 0o600
    assert list(tmp_path.iterdir()) == []  # unlinked at creation
    assert _round_trip(f) == [1, 0, 3]  # the block between was reserved, never written
    f.close()
    assert f.fd == -1


def test_buffered_io_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(swapfile.os, "open", no_direct)
    f = SwapFile(str(tmp_path), "rank0-exp_avg", 3 * ALIGN)
    assert not f.direct and f.mode == 0o600
    assert _round_trip(f) == [1, 0, 3]
    f.close()


def test_a_full_disk_is_named_and_leaves_no_file_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    usage = shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096)  # type: ignore[attr-defined]
    monkeypatch.setattr(swapfile, "_reserve", full)
    monkeypatch.setattr(swapfile.shutil, "disk_usage", lambda path: usage)
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OffloadDiskFull) as raised:
        SwapFile(str(tmp_path), "rank1-exp_avg_sq", 10 * ALIGN)
    assert str(raised.value) == (
        f"offload to NVMe: {str(tmp_path)!r} has no room for rank1-exp_avg_sq (40960 bytes; "
        "4096 free): free space there or set ZeroConfig.offload.path to a larger disk (nothing "
        "was written; the last checkpoint is unaffected)"
    )
    assert raised.value.errno == errno.ENOSPC
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert list(tmp_path.iterdir()) == []
