"""Global-norm gradient clipping over sharded gradients.

Matches ``torch.nn.utils.clip_grad_norm_``: the norm of all gradients as if they were one vector,
then every gradient scaled by ``max_norm / (norm + 1e-6)`` when that is below 1. With sharded
gradients each rank holds a disjoint part, so the p-th powers (or the max, for inf) are combined
with one all-reduce and every rank sees the same total.
"""

from __future__ import annotations

import math

import torch

from zerodp.comm import Communicator


def clip_grad_norm(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    comm: Communicator,
    *,
    sharded: bool,
    device: torch.device,
) -> torch.Tensor:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive or inf; got {norm_type}")
    norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
    total = combine_norms(norms, norm_type, comm, sharded=sharded, device=device)
    clamped = clip_coefficient(total, max_norm)
    if grads:
        torch._foreach_mul_(grads, clamped.to(grads[0].device))
    return total


def combine_norms(
    norms: list[torch.Tensor],
    norm_type: float,
    comm: Communicator,
    *,
    sharded: bool,
    device: torch.device,
) -> torch.Tensor:
    """The total norm (the same on every rank) from this rank's per-tensor norms."""
    if not norms:
        local = torch.zeros((), dtype=torch.float32, device=device)
    else:
        local = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
    if sharded and comm.world_size > 1:
        if math.isinf(norm_type):
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
