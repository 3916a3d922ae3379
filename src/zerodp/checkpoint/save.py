"""``save_checkpoint``: every rank writes only what it owns; rank 0 publishes atomically.

Three phases, each closed by one collective in which every rank reports success or its error,
so that a failure anywhere makes every rank raise the same ``CheckpointError`` instead of
leaving some blocked: (1) prepare (encode, check ``extra``) and make the temporary directory;
(2) write the rank files (each hashed as it is written); (3) rank 0 writes the replicated
tensors, the manifest and the checksum file covering it, then renames the directory into place,
points ``latest`` at it and prunes. No tensor data moves between ranks. See [Note: checkpoint
format] in ``manifest.py`` and [Note: checkpoint checksums] in ``integrity.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerodp.checkpoint import directory as fs
from zerodp.checkpoint import faults, rng
from zerodp.checkpoint.common import (
    attempt,
    raise_if_any,
    state_dict_entries,
    state_of,
)
from zerodp.checkpoint.integrity import CHECKSUMS, write_checksums
from zerodp.checkpoint.manifest import (
    COMMON_FILE,
    MANIFEST,
    BufferRecord,
    CheckpointError,
    Manifest,
    ParamRecord,
    RankRecord,
    SavedPiece,
    StateEntry,
    buffer_key,
    check_json,
    encode,
    model_key,
    param_key,
    rank_file,
    split_range,
    state_key,
)
from zerodp.checkpoint.tensor_parallel import agree_on_save, tp_record, tp_root
from zerodp.checkpoint.tensorfile import FileInfo, TensorFileWriter, TensorSpec, dtype_name
from zerodp.comm import Communicator
from zerodp.optim.pieces import OptimPiece
from zerodp.params.order import Op
from zerodp.partition.layout import Range
from zerodp.tensor_parallel import layout_of
from zerodp.version import __version__
from zerodp.views import CheckpointState


@dataclass
class _Prepared:
    pieces: list[SavedPiece]
    tensors: list[tuple[str, torch.Tensor]]  # what this rank's file holds, in order
    rng_info: dict[str, Any]
    extra: Any
    groups: list[Any]
    scaler: Any


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: nn.Module,
    opt: Any,
    *,
    extra: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Save a sharded checkpoint of ``model`` and its ``ZeroOptimizer`` under the root
    ``directory`` as ``step-<steps>/``, then point ``directory/latest`` at it and, with
    ``keep_last``, delete all but the newest ``keep_last`` step directories. Call on every rank
    (between steps). ``extra``: JSON-serialisable data of this rank (e.g. a sampler's state),
    returned by ``load_checkpoint``. Returns the new checkpoint's directory. With a
    data-parallel sub-group, ``directory`` belongs to the first group that saves into it
    ([Note: one data-parallel group per root])."""
    if layout_of(model) is None:
        return _save(directory, model, opt, extra, keep_last)
    # [Note: tensor-parallel checkpoints]: each TP rank's DP group saves its own root; the TP
    # ranks then agree that all did before any prunes (a step some TP rank lacks is passed
    # over by load_checkpoint, so the older ones must stay until the new one is everywhere).
    if keep_last is not None and (isinstance(keep_last, bool) or not keep_last >= 1):
        raise ValueError(f"keep_last must be a positive integer or None; got {keep_last!r}")
    try:
        path = _save(directory, model, opt, extra, None)
    except Exception as exc:  # a TP rank whose DP group failed: the others raise with it
        agree_on_save(model, directory, str(exc) or type(exc).__name__)
        raise
    agree_on_save(model, directory, "")
    if keep_last is not None and state_of(model, opt).comm.rank == 0:
        fs.prune(path.parent, keep_last, path.name)
    return path


def _save(
    directory: str | os.PathLike[str],
    model: nn.Module,
    opt: Any,
    extra: Any,
    keep_last: int | None,
) -> Path:
    state = state_of(model, opt)
    comm = state.comm
    root = tp_root(directory, model)  # [Note: tensor-parallel checkpoints]
    name = fs.step_dir_name(state.counters.steps)
    header = f"save_checkpoint({root}) failed; earlier checkpoints are untouched:"
    # NVMe: the optimizer's tensors are read into memory while they are written out.
    resident = state.masters.resident(write=False)
    with resident, comm.untracked(), comm.phase("checkpoint save"):
        state.meet(Op.CHECKPOINT)  # [stage 3] meet a rank still in a step at its check
        prep, error = attempt(lambda: _prepare(state, extra, keep_last))
        tmp = None
        if comm.rank == 0 and not error:
            _, error = attempt(lambda: _claim_root(comm, root))
        if comm.rank == 0 and not error:
            tmp, error = attempt(lambda: fs.make_tmp_dir(root, name))
        try:  # a collective that fails (a late or dead rank) leaves no temporary directory
            steps = state.counters.steps
            replies = comm.all_gather_object((error, str(tmp) if tmp else None, steps))
            _check_steps([steps for _, _, steps in replies], header, tmp)
            _check([r[:2] for r in replies], header, tmp if comm.rank == 0 else None)
            tmp = Path(replies[0][1])
            assert prep is not None
            written, error = attempt(lambda: _write_rank_file(tmp, state, prep))
            replies = comm.all_gather_object((error, written))
            _check(replies, header, tmp if comm.rank == 0 else None)
            error = ""
            if comm.rank == 0:
                records = [w for _, w in replies]
                done = (root, name, tmp, model, state, prep, records, keep_last)
                _, error = attempt(lambda: _finish(*done))
                if error:
                    shutil.rmtree(tmp, ignore_errors=True)
            error = comm.broadcast_object(error)
        except BaseException:
            if comm.rank == 0 and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if error:
            raise CheckpointError(f"{header}\n  rank 0: {error}")
    return root / name


def _claim_root(comm: Communicator, root: Path) -> None:
    """[Note: one data-parallel group per root] A job whose data-parallel group is one of
    several (the DP groups of a DP x TP mesh, one per TP rank) has a group rank 0 in every DP
    group, and each would publish its own ``step-N`` into a shared root: the last rename wins
    (a TP model's other shards are silently lost), and one group's stale-file sweep deletes the
    other's half-written temporary directory. The first group to save into a root owns it for
    the job; any other group's save raises before writing anything. The whole world has no
    other group to meet, so its saves stay free of the store operation."""
    if comm.is_default_group:
        return
    holder = comm.claim("checkpoint-root:" + os.path.realpath(root))
    if holder == comm.members:
        return
    raise CheckpointError(
        f"{root} is the checkpoint root of another data-parallel group of this job (global "
        f"ranks {list(holder)}); this group (global ranks {list(comm.members)}) would overwrite "
        "its checkpoints. With a DP x TP mesh, save each tensor-parallel rank to its own "
        'directory (e.g. f"{root}/tp{tp_rank}"); a model replicated across tensor-parallel '
        "ranks can instead be saved by one data-parallel group only (tp_rank 0) and loaded by all"
    )


def _check_steps(steps: list[int], header: str, tmp: Path | None) -> None:
    """Ranks that ran different numbers of optimizer steps would save a mix of states."""
    if len(set(steps)) == 1:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    detail = ", ".join(f"rank {r} after {n}" for r, n in enumerate(steps))
    raise CheckpointError(
        f"{header}\n  ranks are at different steps ({detail} optimizer steps): every rank "
        "must run the same number of optimizer steps before save_checkpoint"
    )


def _check(replies: list[Any], header: str, cleanup: Path | None) -> None:
    errors = [e for e, _ in replies]
    if any(errors) and cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    raise_if_any(errors, header)


# -- phase 1: what this rank writes -------------------------------------------------------------


def _prepare(state: CheckpointState, extra: Any, keep_last: int | None) -> _Prepared:
    problem = check_json(extra, "extra")
    if problem:
        raise TypeError(problem)
    if keep_last is not None and (isinstance(keep_last, bool) or not keep_last >= 1):
        raise ValueError(f"keep_last must be a positive integer or None; got {keep_last!r}")
    pieces, tensors = [], []
    for op, r in _owned(state):
        piece, items = _describe(state, op, r)
        pieces.append(piece)
        tensors += items
    rng_tensors, rng_info = rng.capture()
    tensors += list(rng_tensors.items())
    groups = [
        encode({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
        for i, g in enumerate(state.optimizer.param_groups)
    ]
    scaler = state.scaler
    scaler_state = None if scaler is None else encode(scaler.state_dict(), "loss scaler state")
    return _Prepared(pieces, tensors, rng_info, extra, groups, scaler_state)


def _owned(state: CheckpointState) -> Iterator[tuple[OptimPiece, Range]]:
    """(piece, the range of it this rank writes). Stage 0 holds every piece on every rank:
    each rank writes a 1/N of each, so the writing is spread and nothing is written twice."""
    rank, world = state.comm.rank, state.comm.world_size
    for op in state.pieces:
        r: Range | None = op.piece.param_range
        if state.stage == 0:
            r = split_range(op.piece.param_range, world, rank)
        if r is not None:
            yield op, r


def _describe(
    state: CheckpointState, op: OptimPiece, r: Range
) -> tuple[SavedPiece, list[tuple[str, torch.Tensor]]]:
    base = op.piece.param_range.start
    local = slice(r.start - base, r.stop - base)
    items = [(param_key(op.name, r), op.tensor.detach()[local])]
    entries: dict[str, StateEntry] = {}
    for key, value in state.optimizer.state.get(op.tensor, {}).items():
        where = f"optimizer state {key!r} of '{op.name}'"
        if isinstance(value, torch.Tensor):
            dtype = dtype_name(value.dtype)
            if value.shape == op.tensor.shape:
                entries[key] = StateEntry("elem", dtype)
                items.append((state_key(key, op.name, r), value.detach()[local]))
            elif value.dim() == 0:
                entries[key] = StateEntry("scalar", dtype, value.item())
            else:
                entries[key] = StateEntry("tensor", dtype, shape=tuple(value.shape))
                items.append((state_key(key, op.name, r), value.detach()))
        elif value is None or isinstance(value, (bool, int, float, str)):
            entries[key] = StateEntry("json", value=value)
        else:
            raise TypeError(f"{where} is a {type(value).__name__}, which cannot be saved")
    piece = SavedPiece(op.name, r, op.group, dtype_name(op.tensor.dtype), entries)
    return piece, items


# -- phase 2: the rank file ---------------------------------------------------------------------


def _write_rank_file(
    tmp: Path, state: CheckpointState, prep: _Prepared
) -> tuple[RankRecord, FileInfo]:
    rank = state.comm.rank
    name = rank_file(rank)
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in prep.tensors]
    hook = faults.hooks.writing_rank_file  # None but in tests that kill a rank mid-save
    with TensorFileWriter(tmp / name, specs) as writer:
        for i, (key, tensor) in enumerate(prep.tensors):
            if hook is not None:
                hook(rank, i, len(prep.tensors), writer.flush)
            writer.write(key, tensor)
        info = writer.close()
    record = RankRecord(rank, name, tuple(prep.pieces), prep.rng_info, prep.extra)
    return record, info


# -- phase 3: rank 0 finishes and publishes -----------------------------------------------------


def _finish(
    root: Path,
    name: str,
    tmp: Path,
    model: nn.Module,
    state: CheckpointState,
    prep: _Prepared,
    written: list[tuple[RankRecord, FileInfo]],
    keep_last: int | None,
) -> None:
    pieces = {pc.name: pc for rec, _ in written for pc in rec.pieces}
    replicated = [n for n, _ in model.named_parameters() if n not in pieces]
    files = {rec.file: info.to_json() for rec, info in written}
    files[COMMON_FILE] = _write_common(tmp / COMMON_FILE, model, replicated).to_json()
    manifest = Manifest(
        step=state.counters.steps,
        world_size=state.comm.world_size,
        stage=state.stage,
        precision=state.precision,
        config=state.config,
        optimizer={"class": type(state.optimizer).__name__, "param_groups": prep.groups},
        scaler=prep.scaler,
        params=tuple(_param_record(n, p, pieces.get(n)) for n, p in model.named_parameters()),
        buffers=tuple(
            BufferRecord(n, tuple(b.shape), dtype_name(b.dtype)) for n, b in model.named_buffers()
        ),
        state_dict=tuple(state_dict_entries(model)),
        ranks=tuple(sorted((rec for rec, _ in written), key=lambda r: r.rank)),
        files=files,
        counters=state.counters.saved(),
        versions=_versions(),
        checksums=CHECKSUMS,
        tensor_parallel=tp_record(model),
    )
    # Bytes, hashed as written: the digest is of exactly what is on disk (no newline
    # translation), and the checksum file covering the manifest comes last ([Note: checkpoint
    # checksums]); publish() fsyncs both before the rename makes the checkpoint visible.
    data = manifest.to_json().encode("utf-8")
    with open(tmp / MANIFEST, "wb") as f:
        f.write(data)
    digests = {f: rec["sha256"] for f, rec in files.items()}
    digests[MANIFEST] = hashlib.sha256(data).hexdigest()
    write_checksums(tmp, digests)
    fs.publish(tmp, root / name)
    fs.write_latest(root, name)
    fs.remove_stale(root)
    if keep_last is not None:
        fs.prune(root, keep_last, name)


def _write_common(path: Path, model: nn.Module, replicated: list[str]) -> FileInfo:
    """Tensors every rank holds whole (frozen or never-optimized parameters, buffers): written
    once, flattened, so that every stored tensor is read the same way (1-D slices)."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    items = [(model_key(n), params[n]) for n in replicated]
    items += [(buffer_key(n), b) for n, b in model.named_buffers()]
    specs = [TensorSpec(k, t.dtype, (t.numel(),)) for k, t in items]
    with TensorFileWriter(path, specs) as writer:
        for key, t in items:
            writer.write(key, t.detach().reshape(-1))
        return writer.close()


def _param_record(name: str, p: nn.Parameter, piece: SavedPiece | None) -> ParamRecord:
    dtype = dtype_name(p.dtype)
    master = piece.dtype if piece is not None else dtype
    return ParamRecord(name, tuple(p.shape), dtype, master, piece is not None, p.requires_grad)


def _versions() -> dict[str, str]:
    import safetensors

    return {
        "zerodp": __version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }
