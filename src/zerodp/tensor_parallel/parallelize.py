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


def check_split_root(model: nn.Module) -> None:
    """Raise if a submodule of ``model`` was split and ``model`` itself was not: zerodp would
    not see the tensor-parallel group (its norms and step agreement would leave it out and the
    whole parameters would drift apart across it)."""
    if layout_of(model) is not None:
        return
    for name, module in model.named_modules():
        if name and layout_of(module) is not None:
            raise ValueError(
                f"{name} was split with zerodp.tensor_parallel.parallelize and the model given "
                "to zerodp.initialize was not: parallelize the model you pass to initialize "
                f"(the plan's names then start with '{name}.')"
            )


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
    splits = {
        f"{name}.{param_name}": split
        for name, (module, style) in chosen.items()
        for param_name, split in _splits_of(module, style).items()
    }
    slices = _slices(model, splits, tp)  # checks tied parameters before anything changes
    for module, style in chosen.values():
        _install_forward(module, style, tp)
    for name, piece in slices.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, piece)
    model.__dict__[_LAYOUT] = Layout(tp, splits)
    return model


def _slices(model: nn.Module, splits: dict[str, Split], tp: TensorParallel) -> dict[str, Any]:
    """This rank's new parameter for every name in ``splits``: one per tied parameter, under
    each of its names. A parameter tied to one the plan splits otherwise (or not at all) is an
    error: its aliases would part."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    out: dict[str, Any] = {}
    for key, names in aliases.items():
        split = {splits.get(n) for n in names}
        if split == {None}:
            continue
        if len(split) > 1:
            ways = ", ".join(f"{n} {splits.get(n) or 'whole'}" for n in names)
            raise ValueError(
                f"tied parameters must be split alike, or untied first: {ways} (give both "
                "modules styles that split the weight the same way, e.g. VocabEmbedding and "
                "Colwise for a tied embedding and head)"
            )
        (how,) = split
        assert how is not None
        param = params[key]
        piece = local_slice(param.detach(), how, tp.rank, tp.size).clone()
        shared = nn.Parameter(piece, requires_grad=param.requires_grad)
        out.update(dict.fromkeys(names, shared))
    return out


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
    if isinstance(module, nn.Embedding) and (
        module.max_norm is not None or module.sparse or module.scale_grad_by_freq
    ):
        raise ValueError(
            f"{name}: a vocabulary-parallel embedding with max_norm, sparse or "
            "scale_grad_by_freq is not built"
        )
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


def _splits_of(module: nn.Module, style: Style) -> dict[str, Split]:
    if isinstance(style, Colwise):
        splits = {"weight": Split(0, style.chunks)}
        if getattr(module, "bias", None) is not None:
            splits["bias"] = Split(0, style.chunks)
        return splits
    return {"weight": Split(1 if isinstance(style, Rowwise) else 0)}


def _install_forward(module: nn.Module, style: Style, tp: TensorParallel) -> None:
    """The module's tensor-parallel forward (its parameters are replaced by ``parallelize``)."""
    if isinstance(style, Colwise):
        forward: Any = functools.partial(_colwise, tp=tp, gather=style.gather_output)
    elif isinstance(style, Rowwise):
        forward = functools.partial(_rowwise, tp=tp)
    else:
        forward = functools.partial(_vocab, tp=tp)
    _resize_attributes(module, style, tp.size)
    # Bound to the instance: a deep copy of the model binds its copy (the group is shared).
    module.forward = types.MethodType(forward, module)


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
