"""Streaming safetensors writer, and a reader that opens files lazily and reads only slices.

Why a writer of our own: ``safetensors.torch.save_file`` takes every tensor at once (the whole
output in memory: fatal for offline consolidation of a big model), refuses tensors that share
storage (every piece is a view into one flat buffer) and would need a second pass over the file
for its checksum. The format is small and stable: an 8-byte little-endian header length, a JSON
header ``{key: {"dtype", "shape", "data_offsets"}}`` (offsets into the data, contiguous and in
order), padded with spaces to 8 bytes, then the raw little-endian bytes. Everything written here
is read back with the ``safetensors`` library itself (tests/unit/test_manifest.py checks this).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


class TensorFileWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``, hashing as it goes.

    The header (all keys, dtypes, shapes) is written first, so a caller holds one tensor at a
    time. ``close`` flushes and fsyncs and returns the size and SHA-256 of the whole file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        metadata: dict[str, str] | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("zerodp checkpoints are written on little-endian machines only")
        self._specs = list(specs)
        self._next = 0
        self._hash = hashlib.sha256()
        self._size = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._emit(_header(self._specs, metadata))

    def write(self, key: str, tensor: torch.Tensor) -> None:
        spec = self._specs[self._next] if self._next < len(self._specs) else None
        if spec is None or spec.key != key:
            raise RuntimeError(f"tensor {key!r} written out of order (expected {spec})")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"tensor {key!r} is {tensor.dtype}{tuple(tensor.shape)}, its header entry says "
                f"{spec.dtype}{spec.shape}"
            )
        self._next += 1
        if tensor.numel() == 0:
            return
        t = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._emit(_raw_bytes(t))
        del t

    def close(self) -> FileInfo:
        if self._next != len(self._specs):
            missing = [s.key for s in self._specs[self._next :]]
            self.abort()
            raise RuntimeError(f"file closed before these tensors were written: {missing[:5]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return FileInfo(self._size, self._hash.hexdigest())

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    def flush(self) -> None:
        """Push the bytes written so far to the OS (``faults``: before a test kills the rank)."""
        self._file.flush()

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU uint8 tensor's memory (valid while ``t`` lives)."""
    try:
        return t.numpy().data
    except RuntimeError:  # torch built without numpy
        return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = metadata
    offset = 0
    for spec in specs:
        if spec.dtype not in _ST_DTYPES:
            raise TypeError(f"cannot store {spec.key!r}: dtype {spec.dtype} is not supported")
        if spec.key in entries:
            raise ValueError(f"duplicate tensor key {spec.key!r}")
        end = offset + spec.nbytes
        entries[spec.key] = {
            "dtype": _ST_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(text)) + text


class ShardReader:
    """Opens the files of one checkpoint directory on first use (``safe_open`` memory-maps them)
    and reads only the requested slices. ``close`` unmaps everything: a long-running reader
    (consolidation) calls it between parameters, so mapped pages never pile up in its RSS."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            path = os.path.join(self.directory, file)
            h = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            self._handles[file] = h
        return h

    def slice(self, file: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the 1-D tensor ``key``."""
        out: torch.Tensor = self._handle(file).get_slice(key)[start:stop]
        return out

    def tensor(self, file: str, key: str) -> torch.Tensor:
        out: torch.Tensor = self._handle(file).get_tensor(key)
        return out

    def close(self) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._handles.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
