"""Cross-entropy over logits split by vocabulary across the TP group (Megatron's
vocabulary-parallel loss): no rank ever holds the full ``[tokens, vocab]`` logits.

Each rank holds the columns ``[start, start + V/TP)``. Three all-reduces over ``[tokens]``
vectors replace the full softmax: the max (for a stable exponent), the sum of exponentials,
and the target's logit (only the rank owning the target column contributes it). Backward is
local: ``softmax - one_hot(target)`` restricted to this rank's columns. Matches
``F.cross_entropy(logits, target, ignore_index=..., reduction="mean")``: the mean over the
tokens whose target is not ``ignore_index``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.tensor_parallel.group import TensorParallel


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp: TensorParallel,
        ignore_index: int,
    ) -> torch.Tensor:
        width = logits.shape[-1]
        start = tp.rank * width
        logits_max = logits.max(dim=-1).values
        tp.comm.all_reduce(logits_max, op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        elsewhere = (target < start) | (target >= start + width)
        local = (target - start).masked_fill(elsewhere, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = shifted[rows, local].masked_fill(elsewhere, 0.0)
        tp.comm.all_reduce(picked)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        tp.comm.all_reduce(sum_exp)
        valid = target != ignore_index
        count = valid.sum()
        losses = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, elsewhere, valid, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, elsewhere, valid, count = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        out = softmax.clone()
        out[rows, local] -= (~elsewhere).to(out.dtype)
        scale = valid.to(out.dtype) * (grad / count)
        return out.mul_(scale.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: TensorParallel, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits [N, V/TP]`` (this rank's vocabulary columns, in rank
    order) against ``target [N]`` (full-vocabulary ids); the same value on every TP rank."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy takes logits [N, V/TP] and target [N]; got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if tp.size == 1:
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index)
    # In fp32 whatever the logits' dtype: the softmax over the vocabulary is where low
    # precision hurts most (the gradient comes back in the logits' dtype).
    return _VocabParallelCrossEntropy.apply(logits.float(), target, tp, ignore_index)
