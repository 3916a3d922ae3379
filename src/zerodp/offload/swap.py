"""``SwapStore``: the fp32 masters and the optimizer state of this rank's chunks on NVMe.

[Note: optimizer state on NVMe]
With ``ZeroConfig.offload.optimizer="nvme"`` nothing of the optimizer's tensors stays in host
memory between steps. Per *chunk* (one bucket's owned region, the unit of the offloaded step,
[Note: offloaded step]) each tensor group has an aligned extent in its own file ([Note: swap
files]): the masters, and each per-element state the optimizer keeps (Adam: ``exp_avg``,
``exp_avg_sq``; discovered from the optimizer's ``state`` after a chunk's first step, so any
element-wise optimizer works). Between steps every piece tensor the optimizer holds
(``param_groups``) and each of those state tensors is an empty tensor: nothing stale can be read
as if it were current, and no host memory is held.

The step swaps one chunk at a time through ``slots`` host buffers per group: ``read`` (a host
worker, ``slots`` chunks ahead, once the write that last used the slot is done) fills the slot
from the files; ``bind`` points the chunk's piece tensors and state tensors at it (``set_`` on the
pieces: the optimizer keys its state by them); the optimizer steps it in place; ``write`` (a
host worker) copies in any state the step created (a first step allocates it), writes the slot
back and empties the tensors again. The user's ``state`` dict keeps the scalar entries (Adam's
``step``) in memory.

Whatever reads or writes the optimizer's tensors outside the step (checkpoints, ``state_dict``,
edits of parameters written back to the masters) does it inside ``resident()``: every chunk is
read into full host tensors, the masters are shard buffers again and the pieces views of them,
and on leaving (``write=True``) everything is written back and emptied. That needs the full
12 B/param of host memory while it lasts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from zerodp.offload.swapfile import SwapFile, aligned, aligned_empty
from zerodp.optim.masters import Masters
from zerodp.optim.pieces import OptimPiece
from zerodp.partition.buffers import OwnedStorage
from zerodp.streams import Event, Streams

MASTERS = "masters"


class Chunk(Protocol):
    seg: int
    numel: int
    pieces: tuple[tuple[int, int, int], ...]  # (index in pieces, offset in chunk, numel)

    def of(self, storage: OwnedStorage) -> torch.Tensor: ...


class SwapStore:
    def __init__(
        self,
        streams: Streams,
        directory: str,
        rank: int,
        chunks: Sequence[Chunk],
        pieces: list[OptimPiece],
        optimizer: torch.optim.Optimizer,
        masters: Masters,
        slots: int,
    ) -> None:
        self.streams = streams
        self.directory = directory
        self.rank = rank
        self.chunks = chunks
        self.pieces = pieces
        self.optimizer = optimizer  # its ``state`` is replaced by ``load_state_dict``: read live
        self.masters = masters
        self.slots = slots
        self.offsets: list[int] = []  # of each chunk's extent, in every file
        offset = 0
        for c in chunks:
            self.offsets.append(offset)
            offset += aligned(4 * c.numel)
        self.file_bytes = offset
        self.slot_bytes = aligned(4 * max((c.numel for c in chunks), default=1))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.files: dict[str, SwapFile] = {}
        self.rings: dict[str, list[torch.Tensor]] = {}
        self.keys: dict[int, tuple[str, ...]] = {}  # piece index -> its state groups on file
        self.writes: list[Event] = []  # of the last step, waited by ``wait``
        self._group(MASTERS)
        for k, c in enumerate(chunks):  # the initial masters, then none in host memory
            self.masters_of(k, 0).copy_(c.of(masters.storage(c.seg)))
            self._write_group(MASTERS, k, 0)
        for c in chunks:
            for i, _, _ in c.pieces:
                _empty(pieces[i].tensor)
        masters.store = self
        masters.evict()

    # -- files and slots --------------------------------------------------------------------

    def _group(self, key: str) -> None:
        if key in self.files:
            return
        self.files[key] = SwapFile(self.directory, f"rank{self.rank}-{key}", self.file_bytes)
        self.rings[key] = [aligned_empty(self.streams, self.slot_bytes) for _ in range(self.slots)]

    def section(self, key: str, slot: int) -> torch.Tensor:
        """Slot ``slot % slots`` of group ``key``, as fp32."""
        return self.rings[key][slot % self.slots].view(torch.float32)

    def _extent(self, key: str, k: int, slot: int) -> torch.Tensor:
        """Chunk ``k``'s aligned extent of that slot: what one read or write moves."""
        return self.rings[key][slot % self.slots].narrow(0, 0, aligned(4 * self.chunks[k].numel))

    def _write_group(self, key: str, k: int, slot: int) -> None:
        self.files[key].write(self.offsets[k], self._extent(key, k, slot))

    def _chunk_keys(self, k: int) -> list[str]:
        found = {key for i, _, _ in self.chunks[k].pieces for key in self.keys.get(i, ())}
        return [MASTERS, *sorted(found)]

    # -- the step, one chunk at a time (on host workers) --------------------------------------

    def read(self, k: int, slot: int) -> None:
        """Chunk ``k`` (an index in ``chunks``) from its files into ``slot`` of each group."""
        for key in self._chunk_keys(k):
            self.files[key].read(self.offsets[k], self._extent(key, k, slot))

    def bind(self, k: int, slot: int) -> None:
        """Point chunk ``k``'s pieces and their state at ``slot`` (after ``read``)."""
        with torch.no_grad():
            for i, off, n in self.chunks[k].pieces:
                op = self.pieces[i]
                _point(op.tensor, self.section(MASTERS, slot).narrow(0, off, n))
                st = self.optimizer.state.get(op.tensor)
                for key in self.keys.get(i, ()):
                    assert st is not None
                    st[key] = self.section(key, slot).narrow(0, off, n)

    def masters_of(self, k: int, slot: int) -> torch.Tensor:
        return self.section(MASTERS, slot).narrow(0, 0, self.chunks[k].numel)

    def write(self, k: int, slot: int) -> None:
        """Chunk ``k``'s masters and state (bound or newly created) to its files, then empty."""
        self._capture(k, slot)
        for key in self._chunk_keys(k):
            self._write_group(key, k, slot)
        self._unbind(k)

    def _capture(self, k: int, slot: int) -> None:
        """Copy into the slot what is not in it already: state the step just created."""
        for i, off, n in self.chunks[k].pieces:
            st = self.optimizer.state.get(self.pieces[i].tensor)
            keys = []
            for key, value in (st or {}).items():
                if not _per_element(value, n):
                    continue
                self._group(key)
                dst = self.section(key, slot).narrow(0, off, n)
                if dst.data_ptr() != value.data_ptr():
                    dst.copy_(value.reshape(-1))
                keys.append(key)
            self.keys[i] = tuple(sorted(keys))

    def _unbind(self, k: int) -> None:
        for i, _, _ in self.chunks[k].pieces:
            op = self.pieces[i]
            _empty(op.tensor)
            st = self.optimizer.state.get(op.tensor)
            for key in self.keys.get(i, ()):
                assert st is not None
                st[key] = torch.empty(0)

    def wait(self) -> None:
        """Every chunk written back (raises what a write raised)."""
        writes, self.writes = self.writes, []
        for event in writes:
            event.wait()

    # -- outside the step -----------------------------------------------------------------------

    @contextmanager
    def resident(self, *, write: bool) -> Iterator[None]:
        """Every chunk in host memory (see the note); written back on leaving if ``write``."""
        self.wait()
        self.masters.restore()
        restored = 0
        try:
            with torch.no_grad():
                for k, c in enumerate(self.chunks):
                    self._restore(k, c)  # through slot 0 of each group
                    restored += 1
            yield
        finally:
            complete = restored == len(self.chunks)  # never write back a partial restore
            with torch.no_grad():
                for k in range(restored):
                    if write and complete:
                        self._store(k)
                    else:
                        self._unbind(k)
            self.masters.evict()

    def _restore(self, k: int, c: Chunk) -> None:
        self.read(k, 0)
        master = self.masters.storage(c.seg)
        c.of(master).copy_(self.masters_of(k, 0))
        for i, off, n in c.pieces:
            op = self.pieces[i]
            _point(op.tensor, master.piece(op.piece))
            st = self.optimizer.state.get(op.tensor)
            for key in self.keys.get(i, ()):
                assert st is not None
                st[key] = self.section(key, 0).narrow(0, off, n).clone()

    def _store(self, k: int) -> None:
        c = self.chunks[k]
        self.masters_of(k, 0).copy_(c.of(self.masters.storage(c.seg)))
        self.write(k, 0)

    # -- accounting and teardown --------------------------------------------------------------

    @property
    def nvme_nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read from and written to the files since they were made."""
        files = self.files.values()
        return sum(f.bytes_read for f in files), sum(f.bytes_written for f in files)

    @property
    def host_nbytes(self) -> int:
        return sum(b.numel() for ring in self.rings.values() for b in ring)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _per_element(value: Any, numel: int) -> bool:
    """A state tensor with one fp32 value per element of the piece (not a scalar ``step``)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == numel
        and value.dtype == torch.float32
    )


def _point(t: torch.Tensor, source: torch.Tensor) -> None:
    """Make ``t`` (the same object: the optimizer keys its state by it) view ``source``."""
    with torch.no_grad():
        t.set_(source)  # type: ignore[call-overload]  # the Tensor overload is not in the stubs


def _empty(t: torch.Tensor) -> None:
    _point(t, torch.empty(0, dtype=t.dtype, device=t.device))
