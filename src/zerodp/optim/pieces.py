"""Rebinding the user's optimizer from whole parameters to the pieces this rank owns.

The user's ``torch.optim`` optimizer object is kept (its class, hyperparameters, hooks and any
attribute a scheduler relies on), and each param group's ``"params"`` is replaced by 1-D views
of the pieces of that group's parameters this rank owns (see [Note: flat buffers]). An
element-wise optimizer stepping a piece computes exactly what it would on the element range of
the whole parameter; per-piece state also keeps per-parameter step counts exact (a parameter
that got no gradient is skipped, as ``torch.optim`` skips a ``None`` grad).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.partition.buffers import OwnedStorage
from zerodp.partition.layout import Piece
from zerodp.partition.segment import Segment

# Optimizers whose update of an element depends only on that element's gradient and state.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
)


@dataclass(slots=True)
class OptimPiece:
    """One optimizer-visible tensor: a view of the master storage for ``piece``."""

    seg: int
    slot: int
    name: str
    piece: Piece
    group: int
    tensor: torch.Tensor  # 1D alias of the master storage; what the optimizer updates
    grad: torch.Tensor  # 1D view into the reduced-gradient storage


def check_optimizer(optimizer: torch.optim.Optimizer, model_params: Iterable[nn.Parameter]) -> str:
    """Return an error message (empty if fine) so that every rank can agree before raising."""
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        return (
            f"zerodp shards optimizer state element-wise and supports {names}; got "
            f"{type(optimizer).__name__}, whose update mixes elements of a parameter"
        )
    known = {id(p) for p in model_params}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                return (
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    "not a parameter of the model passed to zerodp.initialize: build the "
                    "optimizer from model.parameters()"
                )
    return ""


# Optimizers with a fused (single-kernel, multi-tensor) implementation in torch.
FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def select_fused(optimizer: torch.optim.Optimizer) -> list[int]:
    """Use torch's fused kernel for every param group that left both ``foreach`` and ``fused``
    unset (``None``): the pieces are plain dense tensors of one device and dtype, which is what
    the fused path needs, and it steps ~2x faster than the default foreach path on CPU (12.5M
    fp32 elements: 9.5 ms vs 21 ms) with results equal to ~1e-10 relative. A user who sets
    ``foreach`` or ``fused`` explicitly keeps that choice. Returns the groups switched."""
    if type(optimizer) not in FUSABLE:
        return []
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    switched = []
    for gi, group in enumerate(optimizer.param_groups):
        params = group["params"]
        unset = group.get("fused") is None and group.get("foreach") is None
        if not unset or group.get("differentiable") or not params:
            continue
        devices = {p.device.type for p in params}
        dtypes = {p.dtype for p in params}
        if devices <= supported and len(dtypes) == 1 and dtypes <= set(_FLOAT_DTYPES):
            group["fused"] = True
            switched.append(gi)
    return switched


def group_of_params(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}


def make_pieces(
    segments: list[Segment],
    pieces_per_segment: list[list[Piece]],
    groups: dict[int, int],
    master: list[OwnedStorage],
    grads: list[OwnedStorage],
) -> list[OptimPiece]:
    """Views for every owned piece of every parameter that the optimizer holds."""
    out: list[OptimPiece] = []
    for i, (seg, pieces) in enumerate(zip(segments, pieces_per_segment, strict=True)):
        for pc in pieces:
            group = groups.get(id(seg.params[pc.slot]))
            if group is None:  # trainable but not given to the optimizer: reduced, never updated
                continue
            out.append(
                OptimPiece(
                    i,
                    pc.slot,
                    seg.names[pc.slot],
                    pc,
                    group,
                    alias(master[i].piece(pc)),
                    grads[i].piece(pc),
                )
            )
    return out


def alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s memory that is not a view of its base.

    Why: the optimizer's tensors are re-pointed later (the NVMe store points them at its ring
    slots and empties them between steps, keeping the same objects, which key the optimizer's
    state), and a view keeps its base tensor alive whatever it is pointed at next. A view of
    the initial masters would keep every one alive: 4 B/param of host memory that the NVMe
    store exists to free (at stage 3 with the parameters on NVMe, the shards themselves)."""
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    with torch.no_grad():
        return out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, pieces: list[OptimPiece], segments: list[Segment]
) -> None:
    """Replace each group's params by its pieces, converting any existing per-parameter state
    (e.g. loaded before ``initialize``) to per-piece state. Empty groups stay (empty)."""
    old_state = {id(p): st for p, st in optimizer.state.items()}

    def state_of(op: OptimPiece) -> dict | None:
        param = segments[op.seg].params[op.slot]
        st = old_state.get(id(param))
        return None if st is None else _slice_state(st, param, op.piece)

    _bind(optimizer, pieces, state_of)


def replace_pieces(
    optimizer: torch.optim.Optimizer, old: list[OptimPiece], new: list[OptimPiece]
) -> None:
    """Rebind the optimizer from ``old`` to ``new`` pieces (rebuilt views, pieces added), moving
    each old piece's state to the new piece of the same parameter range."""

    def key(op: OptimPiece) -> tuple[int, int, int, int]:
        r = op.piece.param_range
        return op.seg, op.slot, r.start, r.stop

    state = {key(op): optimizer.state[op.tensor] for op in old if op.tensor in optimizer.state}
    _bind(optimizer, new, lambda op: state.get(key(op)))


def _bind(
    optimizer: torch.optim.Optimizer,
    pieces: list[OptimPiece],
    state_of: Callable[[OptimPiece], dict | None],
) -> None:
    """Each group's params := its pieces, in order; state from ``state_of`` (None: none)."""
    states = [state_of(op) for op in pieces]  # before clearing: state_of may read the old state
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.state.clear()
    for op, st in zip(pieces, states, strict=True):
        optimizer.param_groups[op.group]["params"].append(op.tensor)
        if st is not None:
            optimizer.state[op.tensor] = st
    select_fused(optimizer)


def pieces_in_state_order(
    optimizer: torch.optim.Optimizer, pieces: list[OptimPiece]
) -> list[OptimPiece]:
    """The pieces in the order ``optimizer.state_dict()`` numbers its tensors: group by group,
    each group's ``params`` in order. ``pieces`` is in layout order, which differs as soon as
    the groups interleave in the layout (e.g. decay / no-decay groups), so entry ``i`` of the
    state dict is labelled by looking up its tensor, never by position in ``pieces``."""
    by_tensor = {id(op.tensor): op for op in pieces}
    return [by_tensor[id(t)] for group in optimizer.param_groups for t in group["params"]]


def _slice_state(state: dict, param: torch.Tensor, piece: Piece) -> dict:
    out = {}
    r = piece.param_range
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            out[key] = value.detach().reshape(-1)[r.start : r.stop].clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()  # scalars such as Adam's step
        else:
            out[key] = value
    return out
