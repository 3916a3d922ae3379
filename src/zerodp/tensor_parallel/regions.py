"""Megatron's tensor-parallel regions as autograd functions ([Note: tensor parallelism]).

- ``copy_to``: enter a region where each TP rank computes its own slice from the same input:
  identity forward; backward sums the input's gradient over TP (every rank's slice used it).
- ``reduce_from``: leave a row-parallel layer: forward sums the partial outputs over TP;
  backward passes the gradient through (every rank goes on with the same summed output, and
  each computes the same loss from it: summing its gradient again would multiply it by TP).
- ``gather_from``: concatenate the slices along the last dimension (full logits for
  generation); backward keeps this rank's slice of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.tensor_parallel.group import TensorParallel


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.tp.comm.all_reduce(grad)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        out = partial.contiguous().clone()
        tp.comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return gather_last(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp = ctx.tp
        return grad.chunk(tp.size, dim=-1)[tp.rank].contiguous(), None


def gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Every TP rank's ``x`` concatenated along the last dimension (no autograd)."""
    x = x.contiguous()
    rows = x.new_empty(tp.size * x.numel())
    tp.comm.all_gather(rows, x.view(-1))
    return torch.cat(rows.view(tp.size, *x.shape).unbind(0), dim=-1)


def copy_to(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyTo.apply(x, tp) if tp.size > 1 else x


def reduce_from(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFrom.apply(x, tp) if tp.size > 1 else x


def gather_from(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _GatherFrom.apply(x, tp) if tp.size > 1 else x
