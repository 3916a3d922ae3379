"""Offline consolidation: a sharded checkpoint -> one plain ``state_dict`` safetensors file.

No process group, no model: the manifest says every key of the plain model's ``state_dict``
(tied weights under each of their names), its shape, and where its elements are. The output
header is written first, then each tensor is assembled from its saved ranges, cast, written and
dropped, and the shard files are unmapped before the next one, so the peak memory is about the
largest tensor (twice when casting) whatever the model's size. docs/checkpoints.md has numbers.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from zerodp.checkpoint import directory as fs
from zerodp.checkpoint.checks import check_manifest
from zerodp.checkpoint.integrity import check_file, read_verified_manifest
from zerodp.checkpoint.manifest import (
    COMMON_FILE,
    CheckpointError,
    Manifest,
    Source,
    buffer_key,
    plan_reads,
    read_manifest,
    sources_by_name,
)
from zerodp.checkpoint.tensor_parallel import (
    check_single_part,
    check_tp_parts,
    full_shape,
    joined,
    newest_common,
    split_of,
    tp_roots,
)
from zerodp.checkpoint.tensorfile import (
    ShardReader,
    TensorFileWriter,
    TensorSpec,
    dtype_from_name,
)
from zerodp.partition.layout import Range

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ConsolidateResult:
    path: Path
    checkpoint: Path
    step: int
    tensors: int
    bytes: int
    sha256: str


def consolidate_checkpoint(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> ConsolidateResult:
    """Write the full ``state_dict`` of the model in ``checkpoint`` (a checkpoint directory, or
    a root whose ``latest`` is used) to the safetensors file ``output``, loadable with
    ``model.load_state_dict(safetensors.torch.load_file(output))``. Parameters are the saved
    master values (fp32 under mixed precision); ``dtype`` ("fp32", "bf16", "fp16" or a torch
    dtype) casts every floating-point tensor. ``verify`` checks the SHA-256 of every file,
    the manifest's first (``verify=False``: salvage what a damaged checkpoint still holds).
    The output appears atomically (written to a temporary name, then renamed). ``progress``
    is called with (bytes written so far, bytes in all) after each tensor. The root of a model
    split over a tensor-parallel group (``tp0/``, ``tp1/``, ...) gives the full model, every
    rank's slices joined ([Note: tensor-parallel checkpoints])."""
    root = Path(checkpoint)
    parts = tp_roots(root)  # [Note: tensor-parallel checkpoints]
    paths = newest_common(parts) if parts else [fs.resolve(root)]
    manifests = [_opened(path, verify) for path in paths]
    if parts is None:
        check_single_part(manifests[0], paths[0])
    else:
        problems = check_tp_parts(manifests)
        if problems:
            raise CheckpointError(f"cannot consolidate {root}:\n  " + "\n  ".join(problems))
    m = manifests[0]
    cast = _parse_dtype(dtype)
    specs = [_spec(m, key, kind, target, cast, len(paths)) for key, kind, target in m.state_dict]
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)  # e.g. a new Hugging Face model directory
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(6)}")
    sources = [sources_by_name(mi) for mi in manifests]
    metadata = {"format": "pt", "zerodp_step": str(m.step)}
    total, done = sum(spec.nbytes for spec in specs), 0
    try:
        with TensorFileWriter(tmp, specs, metadata) as writer, ExitStack() as stack:
            readers = [stack.enter_context(ShardReader(path)) for path in paths]
            for spec, (_, kind, target) in zip(specs, m.state_dict, strict=True):
                split = split_of(m, target) if kind == "param" else None
                ranks = range(len(paths)) if split is not None else range(1)
                ts = [_assemble(manifests[r], sources[r], readers[r], kind, target) for r in ranks]
                for reader in readers:  # unmap the shards: their pages must not pile up in RSS
                    reader.close()
                t = joined(ts, split, _saved_shape(m, kind, target))
                writer.write(spec.key, t.to(spec.dtype).reshape(spec.shape))
                del t, ts
                done += spec.nbytes
                if progress is not None:
                    progress(done, total)
            info = writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    where = root if parts is not None else paths[0]
    return ConsolidateResult(out, where, m.step, len(specs), info.size, info.sha256)


def _opened(path: Path, verify: bool) -> Manifest:
    """The manifest of the checkpoint at ``path``, checked (and its files, with ``verify``)."""
    try:
        m = read_verified_manifest(path, "consolidate") if verify else read_manifest(path)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot consolidate {path}:\n  {exc}") from None
    problems = check_manifest(m)
    if verify:
        problems += [check_file(path, f, rec, "consolidate") for f, rec in sorted(m.files.items())]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"cannot consolidate {path}:\n  " + "\n  ".join(problems))
    return m


def _saved_shape(m: Manifest, kind: str, target: str) -> tuple[int, ...]:
    if kind == "buffer":
        return next(b.shape for b in m.buffers if b.name == target)
    rec = m.param(target)
    assert rec is not None
    return rec.shape


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch.dtype; got {dtype!r}")


def _spec(
    m: Manifest, key: str, kind: str, target: str, cast: torch.dtype | None, tp_size: int
) -> TensorSpec:
    if kind == "param":
        rec = m.param(target)
        assert rec is not None, target
        shape = full_shape(rec.shape, split_of(m, target), tp_size)
        saved = dtype_from_name(rec.master_dtype)
    else:
        buf = next(b for b in m.buffers if b.name == target)
        shape, saved = buf.shape, dtype_from_name(buf.dtype)
    dtype = cast if cast is not None and saved.is_floating_point else saved
    return TensorSpec(key, dtype, shape)


def _assemble(
    m: Manifest, sources: dict[str, list[Source]], reader: ShardReader, kind: str, target: str
) -> torch.Tensor:
    if kind == "buffer":
        return reader.tensor(COMMON_FILE, buffer_key(target))
    rec = m.param(target)
    assert rec is not None
    full = torch.empty(rec.numel, dtype=dtype_from_name(rec.master_dtype))
    for src, inter in plan_reads(sources[target], Range(0, rec.numel)):
        a, b = inter.start - src.range.start, inter.stop - src.range.start
        full[inter.start : inter.stop] = reader.slice(src.file, src.key, a, b)
    return full
