"""Split a model's layers over a tensor-parallel group in place, by a plan of module names.

``parallelize(model, tp, {"blocks.*.attn.c_attn": Colwise(chunks=3), ...})`` replaces, in every
module the plan names, each split parameter by this TP rank's slice (a new ``Parameter``; same
name, so ``state_dict`` keys stay) and the module's ``forward`` *attribute* (the instance's,
not the class's) by the tensor-parallel one. Call it before ``zerodp.initialize``, on the
unsharded model, the same plan on every TP rank; every rank slices the same full weights, so a
model built under one seed trains exactly like that model unsplit. Parameters the plan does not
split (norms, position embeddings, a row-parallel layer's bias) stay whole on every TP rank and
get the same gradient there ([Note: tensor parallelism]).

Styles (Megatron's layout):

- ``Colwise(chunks=1, gather_output=False)``: an ``nn.Linear`` split by output features; its
  input enters through ``copy_to``. ``chunks``: a fused projection (q, k and v in one matrix)
  whose ``chunks`` equal blocks are each split alike, so rank r holds q_r, k_r and v_r.
  ``gather_output``: concatenate the slices (a head whose loss needs the full logits).
- ``Rowwise()``: an ``nn.Linear`` split by input features (it reads a ``Colwise`` output); the
  partial products are summed over TP, then the whole bias is added once.
- ``VocabEmbedding()``: an ``nn.Embedding`` split by rows (token ids); each rank looks up the ids
  it holds, zeros elsewhere, and the results are summed over TP.
"""

from __future__ import annotations

import fnmatch
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.tensor_parallel.group import TensorParallel
from zerodp.tensor_parallel.regions import copy_to, gather_from, reduce_from

_LAYOUT = "_zerodp_tensor_parallel"


@dataclass(frozen=True, slots=True)
class Colwise:
    chunks: int = 1
    gather_output: bool = False


@dataclass(frozen=True, slots=True)
class Rowwise:
    pass


@dataclass(frozen=True, slots=True)
class VocabEmbedding:
    pass


Style = Colwise | Rowwise | VocabEmbedding


@dataclass(frozen=True, slots=True)
class Split:
    """How one parameter is split: along ``dim``, each of ``chunks`` equal blocks alike."""

    dim: int
    chunks: int = 1


@dataclass(frozen=True, slots=True)
class Layout:
    """What ``parallelize`` did to a model: its group and the split parameters, by name."""

    tp: TensorParallel
    splits: dict[str, Split]

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        return self  # immutable, and the group is shared


def layout_of(model: nn.Module) -> Layout | None:
    """The tensor-parallel layout of ``model`` (None: not split)."""
    layout = model.__dict__.get(_LAYOUT)
    return layout if isinstance(layout, Layout) else None


def parallelize(model: nn.Module, tp: TensorParallel, plan: Mapping[str, Style]) -> nn.Module:
    """Split ``model`` over ``tp`` by ``plan`` (module-name patterns, ``fnmatch`` style, to
    styles); returns ``model``. Checks everything before changing anything: on an error the
    model is as it was."""
    if layout_of(model) is not None:
        raise ValueError("the model is split over a tensor-parallel group already")
    if "_zero_engine" in model.__dict__:
        raise ValueError(
            "parallelize the model before zerodp.initialize: zerodp shards the tensor-parallel "
            "slices over the data-parallel group, not the other way round"
        )
    chosen = _match(model, plan)
    for name, (module, style) in chosen.items():
        _check(name, module, style, tp.size)
    splits: dict[str, Split] = {}
    for name, (module, style) in chosen.items():
        for param_name, split in _split_module(module, style, tp).items():
            splits[f"{name}.{param_name}" if name else param_name] = split
    model.__dict__[_LAYOUT] = Layout(tp, splits)
    return model


def _match(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, tuple[nn.Module, Style]]:
    chosen: dict[str, tuple[nn.Module, Style]] = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"the tensor-parallel plan names {pattern!r}, which matches no module of "
                f"{type(model).__name__} (its modules include {names[:6]})"
            )
        for name in hits:
            if name in chosen and chosen[name][1] != style:
                raise ValueError(f"the tensor-parallel plan gives {name} two styles")
            chosen[name] = (model.get_submodule(name), style)
    return chosen


def _check(name: str, module: nn.Module, style: Style, size: int) -> None:
    kind = nn.Embedding if isinstance(style, VocabEmbedding) else nn.Linear
    if not isinstance(module, kind):
        raise ValueError(
            f"{type(style).__name__} splits an nn.{kind.__name__}; {name} is of class "
            f"{type(module).__name__}"
        )
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        raise ValueError(f"{name}: a vocabulary-parallel embedding with max_norm or sparse")
    weight = module.weight
    dim = 1 if isinstance(style, Rowwise) else 0
    chunks = style.chunks if isinstance(style, Colwise) else 1
    if weight.shape[dim] % (chunks * size):
        what = f"{chunks} blocks of " if chunks > 1 else ""
        raise ValueError(
            f"{name}.weight {tuple(weight.shape)} cannot be split into {what}{size} "
            f"tensor-parallel slices along dim {dim}: {weight.shape[dim]} is not divisible by "
            f"{chunks * size}"
        )
    if isinstance(style, Colwise) and style.chunks > 1 and style.gather_output:
        raise ValueError(f"{name}: Colwise(chunks > 1) cannot gather its output in order")


def _split_module(module: nn.Module, style: Style, tp: TensorParallel) -> dict[str, Split]:
    splits: dict[str, Split] = {}
    if isinstance(style, Colwise):
        splits["weight"] = Split(0, style.chunks)
        if getattr(module, "bias", None) is not None:
            splits["bias"] = Split(0, style.chunks)
        forward: Any = functools.partial(_colwise, tp=tp, gather=style.gather_output)
    elif isinstance(style, Rowwise):
        splits["weight"] = Split(1)
        forward = functools.partial(_rowwise, tp=tp)
    else:
        splits["weight"] = Split(0)
        forward = functools.partial(_vocab, tp=tp)
    for param_name, split in splits.items():
        param = getattr(module, param_name)
        piece = local_slice(param.detach(), split, tp.rank, tp.size).clone()
        setattr(module, param_name, nn.Parameter(piece, requires_grad=param.requires_grad))
    _resize_attributes(module, style, tp.size)
    # Bound to the instance: a deep copy of the model binds its copy (the group is shared).
    module.forward = types.MethodType(forward, module)
    return splits


def local_slice(full: torch.Tensor, split: Split, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` (a view when ``split.chunks`` is 1)."""
    blocks = full.chunk(split.chunks, dim=split.dim)
    pieces = [b.chunk(size, dim=split.dim)[rank] for b in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=split.dim)


def join_slices(slices: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The full tensor from every rank's slice, in rank order (``local_slice``'s inverse)."""
    per_rank = [s.chunk(split.chunks, dim=split.dim) for s in slices]
    blocks = [torch.cat([r[b] for r in per_rank], dim=split.dim) for b in range(split.chunks)]
    return torch.cat(blocks, dim=split.dim)


def _resize_attributes(module: nn.Module, style: Style, size: int) -> None:
    # The printed and introspected shapes say what the module holds now.
    if isinstance(module, nn.Linear):
        if isinstance(style, Rowwise):
            module.in_features //= size
        else:
            module.out_features //= size
    elif isinstance(module, nn.Embedding):
        module.num_embeddings //= size


def _colwise(module: nn.Linear, x: torch.Tensor, *, tp: TensorParallel, gather: bool) -> Any:
    out = F.linear(copy_to(x, tp), module.weight, module.bias)
    return gather_from(out, tp) if gather else out


def _rowwise(module: nn.Linear, x: torch.Tensor, *, tp: TensorParallel) -> Any:
    out = reduce_from(F.linear(x, module.weight), tp)
    return out if module.bias is None else out + module.bias


def _vocab(module: nn.Embedding, idx: torch.Tensor, *, tp: TensorParallel) -> Any:
    rows = module.weight.shape[0]
    start = tp.rank * rows
    outside = (idx < start) | (idx >= start + rows)
    pad = module.padding_idx
    local_pad = pad - start if pad is not None and start <= pad < start + rows else None
    out = F.embedding((idx - start).masked_fill(outside, 0), module.weight, local_pad)
    return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), tp)
