"""Global-norm gradient clipping over sharded gradients.

Matches ``torch.nn.utils.clip_grad_norm_``: the norm of all gradients as if they were one vector,
then every gradient scaled by ``max_norm / (norm + 1e-6)`` when that is below 1. With sharded
gradients each rank holds a disjoint part, so the p-th powers (or the max, for inf) are combined
with one all-reduce and every rank sees the same total.

[Note: norms under tensor parallelism]
A model split over a tensor-parallel group ([Note: tensor parallelism]) is one vector spread
over DP *and* TP: the slices of a split parameter add up over TP, while a parameter every TP
rank holds whole has the same gradient on each and must count once. Each rank therefore weighs
the p-th powers of whole parameters by 1 / TP, sums over DP as before, then over TP. Every rank
of both groups gets the same norm, hence the same clip coefficient: the whole parameters stay
identical across TP (with the DP-only norm each TP rank would clip by its own coefficient and
the replicas would drift apart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.tensor_parallel.parallelize import layout_of


@dataclass(frozen=True, slots=True)
class NormScope:
    """The ranks one gradient norm spans: the data-parallel group and, for a model split over a
    tensor-parallel group, that group and the names of the parameters it holds whole."""

    dp: Communicator
    tp: Communicator | None = None
    whole: frozenset[str] = frozenset()


def norm_scope(dp: Communicator, model: nn.Module) -> NormScope:
    """The scope of ``model``'s gradient norm: over ``dp``, and over its tensor-parallel group
    if ``parallelize`` split it."""
    layout = layout_of(model)
    if layout is None:
        return NormScope(dp)
    whole = {name for name, _ in model.named_parameters() if name not in layout.splits}
    return NormScope(dp, layout.tp.comm, frozenset(whole))


def clip_grad_norm(
    grads: list[torch.Tensor],
    names: Sequence[str],
    max_norm: float,
    norm_type: float,
    scope: NormScope,
    *,
    sharded: bool,
    device: torch.device,
) -> torch.Tensor:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive or inf; got {norm_type}")
    norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
    total = combine_norms(norms, names, norm_type, scope, sharded=sharded, device=device)
    clamped = clip_coefficient(total, max_norm)
    if grads:
        torch._foreach_mul_(grads, clamped.to(grads[0].device))
    return total


def combine_norms(
    norms: list[torch.Tensor],
    names: Sequence[str] | None,
    norm_type: float,
    scope: NormScope,
    *,
    sharded: bool,
    device: torch.device,
) -> torch.Tensor:
    """The total norm (the same on every rank) from this rank's per-tensor norms, of the
    parameters ``names`` (None: not known, refused under tensor parallelism)."""
    tp = scope.tp
    infinite = math.isinf(norm_type)
    if tp is not None and names is None and not infinite:
        raise NotImplementedError(
            "clip_grad_norm_ of a tensor-parallel model whose gradients are offloaded is not "
            "built: the offloaded gradients' norms do not say which parameter they belong to "
            "(norm_type=inf is)"
        )
    if not norms:
        local = torch.zeros((), dtype=torch.float32, device=device)
    elif tp is None or infinite:
        local = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
    else:  # [Note: norms under tensor parallelism]
        assert names is not None
        weights = [1.0 / tp.world_size if n in scope.whole else 1.0 for n in names]
        powers = torch.stack([n.float().pow(norm_type) for n in norms])
        local = (powers * torch.tensor(weights, device=powers.device)).sum()
        local = local.pow(1.0 / norm_type)
    for comm, needed in ((scope.dp, sharded), (tp, True)):
        if comm is None or not needed or comm.world_size == 1:
            continue
        if infinite:
            comm.all_reduce_control(local, op="max")
        else:
            local = local.pow(norm_type)
            comm.all_reduce_control(local, op="sum")
            local = local.pow(1.0 / norm_type)
    return local


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What every gradient is multiplied by: ``max_norm / (total + 1e-6)``, at most 1."""
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)
