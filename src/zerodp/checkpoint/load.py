"""``load_checkpoint`` (at any world size and stage) and ``load_model_state_dict``.

Every rank first learns which parameters some rank optimizes (one small ``all_gather_object``
of names: the others must be read whole), validates on its own (the manifest's checksum, the
manifest, model structure, optimizer, and the size and SHA-256 of each file it is going to read:
[Note: checkpoint checksums] in ``integrity.py``), then all ranks exchange
verdicts in one ``all_gather_object``; only if every rank is content does any rank touch its
state. Each rank
then reads, for each piece it owns now, the intersection of that piece's range with the saved
ranges (``plan_reads``), from whichever files hold them, slice by slice, writes the masters and
the optimizer state, and ``publish_params`` refreshes the model's full parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerodp.checkpoint import rng
from zerodp.checkpoint.checks import check_manifest, compare_structure
from zerodp.checkpoint.common import (
    attempt,
    raise_if_any,
    state_dict_entries,
    state_of,
)
from zerodp.checkpoint.integrity import check_file, read_verified_manifest
from zerodp.checkpoint.manifest import (
    COMMON_FILE,
    CheckpointError,
    Manifest,
    Source,
    StateEntry,
    buffer_key,
    decode,
    plan_reads,
    rank_file,
    sources_by_name,
    state_key,
)
from zerodp.checkpoint.tensor_parallel import (
    across_tp,
    agreed_checkpoint,
    sliced,
    tp_problems,
)
from zerodp.checkpoint.tensorfile import ShardReader, dtype_from_name
from zerodp.optim.pieces import OptimPiece
from zerodp.params.access import ShardedParameter
from zerodp.params.order import Op
from zerodp.partition.layout import Range
from zerodp.views import CheckpointState


@dataclass
class _Plan:
    path: Path
    manifest: Manifest
    sources: dict[str, list[Source]]
    whole: list[str]  # parameters this rank reads entirely (no rank optimizes them now)
    same_world: bool


def load_checkpoint(
    directory: str | os.PathLike[str],
    model: nn.Module,
    opt: Any,
    *,
    allow_reshard: bool = True,
) -> Any:
    """Load a checkpoint saved by ``save_checkpoint`` into ``model`` and its ``ZeroOptimizer``
    on every rank: parameters, optimizer state and hyperparameters, loss scaler, step counter
    and (at the same world size) every rank's RNG state. ``directory`` is a checkpoint or a root
    (its ``latest`` is loaded). The world size and stage may differ from the saving run's unless
    ``allow_reshard=False``. Returns the ``extra`` this rank passed to ``save_checkpoint`` (rank
    0's when the world size changed). Raises ``CheckpointError`` on every rank, with nothing
    changed, if the checkpoint is incomplete, corrupted or does not fit the model."""
    state = state_of(model, opt)
    comm = state.comm
    header = f"cannot load checkpoint {directory}; nothing was changed:"
    with comm.untracked(), comm.phase("checkpoint load"):
        state.meet(Op.CHECKPOINT)  # [stage 3] meet a rank still in a step at its check
        mine = sorted({op.name for op in state.pieces})
        optimized = set().union(*comm.all_gather_object(mine))
        # [Note: tensor-parallel checkpoints]: a split model's TP ranks agree on the step.
        target, error = agreed_checkpoint(directory, model)
        plan = None
        if not error:
            plan, error = attempt(lambda: _validate(target, model, state, allow_reshard, optimized))
        raise_if_any(across_tp(comm.all_gather_object(error), model), header)
        assert plan is not None
        with ShardReader(plan.path) as reader, state.masters.resident(write=True):
            _apply(plan, reader, model, state)
            state.publish()
    m = plan.manifest
    return m.ranks[comm.rank if plan.same_world else 0].extra


# -- validation (no state is modified) ----------------------------------------------------------


def _validate(
    directory: str | os.PathLike[str],
    model: nn.Module,
    state: CheckpointState,
    allow_reshard: bool,
    optimized: set[str],
) -> _Plan:
    path = Path(directory)  # resolved by agreed_checkpoint
    m = read_verified_manifest(path)  # every rank: nothing of an edited manifest is used
    world, stage = state.comm.world_size, state.stage
    problems = []
    if not allow_reshard and (m.world_size, m.stage) != (world, stage):
        problems.append(
            f"the checkpoint was saved at world size {m.world_size} and stage {m.stage}, this run "
            f"has world size {world} and stage {stage}; pass allow_reshard=True to reshard"
        )
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape)) for n, b in model.named_buffers()]
    problems += tp_problems(m, model)
    if problems:  # other slices: every shape would differ too
        _raise_problems(problems)
    problems += compare_structure(m, params, buffers)
    problems += _optimizer_problems(m, state)
    if problems:  # the rest assumes the structure matches
        _raise_problems(problems)
    problems += check_manifest(m)
    sources = sources_by_name(m)
    problems += _group_problems(state, sources)
    whole = [n for n, _ in model.named_parameters() if n not in optimized]
    same_world = m.world_size == world
    files = {COMMON_FILE}
    if same_world:  # for the RNG state
        files.add(rank_file(state.comm.rank))
    for op in state.pieces:
        files |= {src.file for src, _ in plan_reads(sources[op.name], op.piece.param_range)}
    for name in whole:
        files |= {src.file for src in sources[name]}
    for file in sorted(files):
        record = m.files.get(file)
        problems.append(
            check_file(path, file, record) if record else f"{file} is not listed in the manifest"
        )
    _raise_problems(problems)
    return _Plan(path, m, sources, whole, same_world)


def _raise_problems(problems: list[str]) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError("\n".join(problems))


def _optimizer_problems(m: Manifest, state: CheckpointState) -> list[str]:
    saved, current = m.optimizer["class"], type(state.optimizer).__name__
    if saved != current:
        return [f"the checkpoint's optimizer is {saved}, this run's is {current}"]
    n_saved, n_now = len(m.optimizer["param_groups"]), len(state.optimizer.param_groups)
    if n_saved != n_now:
        return [f"the checkpoint's optimizer has {n_saved} param groups, this run's has {n_now}"]
    return []


def _group_problems(state: CheckpointState, sources: dict[str, list[Source]]) -> list[str]:
    for op in state.pieces:
        saved = next((s.piece.group for s in sources[op.name] if s.piece is not None), None)
        if saved is not None and saved != op.group:
            return [
                f"parameter '{op.name}' is in optimizer param group {op.group} now but was in "
                f"group {saved} in the checkpoint"
            ]
    return []


# -- applying (after every rank agreed) ---------------------------------------------------------


def _apply(plan: _Plan, reader: ShardReader, model: nn.Module, state: CheckpointState) -> None:
    m, opt_state = plan.manifest, state.optimizer.state
    with torch.no_grad():
        for op in state.pieces:
            opt_state.pop(op.tensor, None)
        for op in state.pieces:
            reads = plan_reads(plan.sources[op.name], op.piece.param_range)
            _fill(op.tensor, op.piece.param_range.start, reads, reader, lambda s: s.key)
            group = state.optimizer.param_groups[op.group]
            new = _piece_state(op, reads, reader, group)
            if new:
                opt_state[op.tensor] = new
        params = dict(model.named_parameters())
        for name in plan.whole:
            p = params[name]
            full = torch.empty(p.numel(), dtype=_saved_dtype(m, name), device=p.device)
            _fill(full, 0, plan_reads(plan.sources[name], Range(0, p.numel())), reader, _key)
            p.copy_(full.view(p.shape))
            _write_masters(state, name, full)
        for name, b in model.named_buffers():
            b.copy_(reader.tensor(COMMON_FILE, buffer_key(name)).view(b.shape))
    for group, saved in zip(state.optimizer.param_groups, m.optimizer["param_groups"], strict=True):
        group.update({k: v for k, v in decode(saved).items() if k != "params"})
    scaler = state.scaler
    if scaler is not None and m.scaler is not None:
        scaler.load_state_dict(decode(m.scaler))
    state.counters.restore(m.step, m.counters)
    state.comm.progress.step = m.step
    if plan.same_world:
        rec = m.ranks[state.comm.rank]
        tensors = {k: reader.tensor(rec.file, k) for k in rec.rng["tensors"]}
        rng.restore(tensors, rec.rng)


def _write_masters(state: CheckpointState, name: str, full: torch.Tensor) -> None:
    """Mixed precision keeps fp32 masters for every trainable parameter, optimized or not, and
    ``publish_params`` casts them into the model: a trainable parameter that no optimizer group
    holds has no piece, so its owned master slices are written here. (In fp32 training the
    masters are the parameters, already written.)"""
    masters = state.masters
    for i, seg in enumerate(state.segments):
        if not masters.is_separate(i) or name not in seg.names:
            continue
        slot = seg.names.index(name)
        storage = masters.storage(i)
        for pc in seg.layout.owned_pieces(masters.owner):
            if pc.slot == slot:
                r = pc.param_range
                storage.piece(pc).copy_(full[r.start : r.stop])


def _key(src: Source) -> str:
    return src.key


def _saved_dtype(m: Manifest, name: str) -> torch.dtype:
    rec = m.param(name)
    assert rec is not None
    return dtype_from_name(rec.master_dtype)


def _fill(
    dst: torch.Tensor,
    base: int,
    reads: list[tuple[Source, Range]],
    reader: ShardReader,
    key: Any,
) -> None:
    """Copy each overlap ``inter`` (parameter coordinates) from its saved piece into ``dst``,
    which holds the parameter's elements from ``base`` on."""
    for src, inter in reads:
        a, b = inter.start - src.range.start, inter.stop - src.range.start
        dst[inter.start - base : inter.stop - base].copy_(reader.slice(src.file, key(src), a, b))


def _piece_state(
    op: OptimPiece,
    reads: list[tuple[Source, Range]],
    reader: ShardReader,
    group: dict[str, Any],
) -> dict[str, Any]:
    """The optimizer state of ``op`` from the saved pieces it overlaps. ``check_manifest``
    already made sure those pieces agree on keys, kinds and scalar values."""
    pieces = [src.piece for src, _ in reads]
    if not pieces or pieces[0] is None:
        return {}  # replicated in the checkpoint: no optimizer state was saved
    r, name = op.piece.param_range, op.name
    out: dict[str, Any] = {}
    for key, entry in pieces[0].state.items():
        if entry.kind == "elem":
            assert entry.dtype is not None
            t = torch.empty(r.numel, dtype=dtype_from_name(entry.dtype), device=op.tensor.device)
            _fill(t, r.start, reads, reader, lambda s, k=key: state_key(k, name, s.range))
            out[key] = t
        elif entry.kind == "tensor":
            src = reads[0][0]
            t = reader.tensor(src.file, state_key(key, name, src.range))
            out[key] = t.to(op.tensor.device)
        elif entry.kind == "scalar":
            out[key] = _scalar(entry, op.tensor.device, group)
        else:
            out[key] = entry.value
    return out


def _scalar(entry: StateEntry, device: torch.device, group: dict[str, Any]) -> torch.Tensor:
    # torch.optim keeps step counters on the CPU unless the group is capturable or fused.
    on_device = bool(group.get("capturable") or group.get("fused"))
    assert entry.dtype is not None
    dtype = dtype_from_name(entry.dtype)
    return torch.tensor(entry.value, dtype=dtype, device=device if on_device else "cpu")


# -- a plain state dict (pretrained weights) ----------------------------------------------------


def load_model_state_dict(
    model: nn.Module, opt: Any, state_dict: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a plain (unsharded) ``state_dict``, e.g. pretrained weights, into a zerodp model at
    any stage, on every rank: every rank copies the values it needs (the masters of its owned
    pieces included), then ``publish_params``. The optimizer state is left as it is. A tied
    weight may appear under any of its names. Errors are raised on every rank, before any
    change."""
    state = state_of(model, opt)
    state_dict = sliced(model, state_dict)  # full weights into a tensor-parallel model
    found, error = attempt(lambda: _match_state_dict(model, state_dict, strict))
    with state.comm.untracked():
        raise_if_any(state.comm.all_gather_object(error), "load_model_state_dict failed:")
        assert found is not None
        with torch.no_grad(), state.masters.resident(write=True):
            for name, p in model.named_parameters():
                if not isinstance(p, ShardedParameter):  # stage 3: shards are written below
                    p.copy_(found[name].view(p.shape))
            for op in state.pieces:  # the masters (the same storage in fp32 training)
                r = op.piece.param_range
                op.tensor.copy_(found[op.name].reshape(-1)[r.start : r.stop])
            for name in {n for seg in state.segments for n in seg.names}:
                _write_masters(state, name, found[name].reshape(-1))
            for name, b in model.named_buffers():
                if name in found:
                    b.copy_(found[name].view(b.shape))
            state.publish()


def _match_state_dict(
    model: nn.Module, sd: dict[str, torch.Tensor], strict: bool
) -> dict[str, torch.Tensor]:
    """canonical name -> tensor, or raise naming every missing, unexpected or misshapen key."""
    entries = state_dict_entries(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers()})
    found: dict[str, torch.Tensor] = {}
    problems = []
    for key, _, target in entries:
        value = sd.get(key)
        if value is None or target in found:
            continue
        if tuple(value.shape) != shapes[target]:
            problems.append(
                f"'{key}' has shape {tuple(value.shape)}, the model's is {shapes[target]}"
            )
        found[target] = value
    missing = sorted({t for _, _, t in entries} - set(found))
    unexpected = sorted(set(sd) - {k for k, _, _ in entries})
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected and strict:
        problems.append(f"unexpected keys: {unexpected}")
    _raise_problems(problems)
    return found
