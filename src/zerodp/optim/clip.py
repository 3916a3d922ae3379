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
    local = _local_norm(grads, norm_type, device)
    if sharded and comm.world_size > 1:
        if math.isinf(norm_type):
            comm.all_reduce_control(local, op="max")
        else:
            local = local.pow(norm_type)
            comm.all_reduce_control(local, op="sum")
            local = local.pow(1.0 / norm_type)
    total = local
    clip_coef = max_norm / (total + 1e-6)
    clamped = torch.clamp(clip_coef, max=1.0)
    if grads:
        torch._foreach_mul_(grads, clamped.to(grads[0].device))
    return total


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, norm_type)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
