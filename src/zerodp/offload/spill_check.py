"""``SpillCheck``: the non-finite check and gradient clipping of a step whose gradients are on
NVMe ([Note: gradients on NVMe] in grad_spill.py).

The offloaded step ([Note: offloaded step] in runner.py) asks a device runner for both; with
the gradient shards in a file there is nothing on the device to read, so this one answers from
what the spill's writer took from each run as it wrote it. Clipping cannot scale the file in
place: the coefficient is a pending factor that the host step multiplies every chunk by as it
unpacks it, after 1/loss scale and after any earlier clip's, the order the mixed-precision
device step applies them in ([Note: chunked fp32 gradients]).
"""

from __future__ import annotations

import torch

from zerodp.offload.grad_spill import GradSpill
from zerodp.optim.clip import NormScope, clip_coefficient, combine_norms
from zerodp.optim.masters import ReducedGrads


class SpillCheck:
    """A ``StepCheck``: it never steps (``OffloadStep`` does)."""

    def __init__(self, spill: GradSpill, device: torch.device) -> None:
        self.spill = spill
        self.device = device
        self.factors: list[torch.Tensor] = []  # this step's clip coefficients, in order

    def nonfinite(self, grads: ReducedGrads, inv_scale: float) -> bool:
        return self.spill.nonfinite()

    def clip(
        self,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        """The global norm of the unscaled, already clipped gradients: a run's unused
        parameters hold zeros (the reduction's fill), which add nothing to any norm."""
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"norm_type must be positive or inf; got {norm_type}")
        norms = [n.to(self.device) for n in self.spill.norms(norm_type)]
        total = combine_norms(norms, None, norm_type, scope, sharded=True, device=self.device)
        if inv_scale != 1.0:  # a power of two: exact
            total = total * inv_scale
        for f in self.factors:
            total = total * f
        self.factors.append(clip_coefficient(total, max_norm))
        return total

    def pending_factors(self) -> list[torch.Tensor]:
        return list(self.factors)

    def reset(self) -> None:
        self.factors = []

    @property
    def nbytes(self) -> int:
        return 0
