"""fp32: whether the reduced gradient this rank owns holds a NaN or inf ([Note: step agreement]).

Mixed precision checks while filling its fp32 scratch ([Note: chunked fp32 gradients]); fp32
training steps the reduced gradient buffers directly, so they are checked in place: every
owned slice (stages 1-3: the shard buffer; stages 0-1: this rank's slice of every bucket of the
full buffer, so that at stage 0 too each element is checked on one rank only) goes through
``torch._amp_foreach_non_finite_check_and_unscale_`` with inverse scale 1, as
``torch.amp.GradScaler`` checks: one fused multi-tensor read, into a persistent one-element
flag. Measured on one CPU core (torch 2.13), 100M fp32 elements: 16 ms, the cost of reading
them once (``max``: 14 ms); ``torch.isfinite(g).all()``: 620-740 ms and a 100 MB temporary;
``aminmax``: 21-31 ms; ``torch._foreach_norm(.., inf)``: 260-390 ms; a fused AdamW step of the
same elements: ~90 ms.
"""

from __future__ import annotations

import torch

from zerodp.optim.masters import ReducedGrads
from zerodp.partition.segment import Segment


class FiniteCheck:
    """The check, with its flag allocated once (a step allocates no tensor data)."""

    def __init__(self, device: torch.device) -> None:
        self._found = torch.zeros(1, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    def nonfinite(self, reducer: ReducedGrads, segments: list[Segment], rank: int) -> bool:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in owned_grads(reducer, segments, rank):
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        if not by_dtype:
            return False
        self._found.zero_()
        for tensors in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, self._found, self._one)
        return bool(self._found.item())


def owned_grads(reducer: ReducedGrads, segments: list[Segment], rank: int) -> list[torch.Tensor]:
    """This rank's slices of the reduced gradients: together, the ranks' slices cover every
    element once."""
    return [t for i in range(len(segments)) for t in reducer.grad_storage(i).owned(rank)]
