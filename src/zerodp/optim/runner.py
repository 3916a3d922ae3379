"""``StepRunner``: how the optimizer step runs over the reduced gradients, chosen once from the
plan, so that the engine's step has no precision branch.

- ``WholeStep`` (fp32): the optimizer steps the owned pieces with ``.grad`` bound to views of the
  reduced gradient storage; clipping and the non-finite check read that storage in place.
- ``ChunkedGrads`` (bf16/fp16, ``optim/chunked.py``): bucket by bucket through a constant-size
  fp32 scratch ([Note: chunked fp32 gradients]).

- ``OffloadStep`` (``offload/runner.py``, ``ZeroConfig.offload``): checks and clips through one
  of the two above, then steps host-resident pieces on the CPU, bucket by bucket, overlapped
  ([Note: offloaded step]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from zerodp.optim.chunked import ChunkedGrads
from zerodp.optim.clip import NormScope, clip_grad_norm
from zerodp.optim.finite import FiniteCheck
from zerodp.optim.masters import ReducedGrads
from zerodp.optim.pieces import OptimPiece
from zerodp.partition.segment import Segment


class StepCheck(Protocol):
    """What decides a step before any update: the non-finite check and clipping (the part of
    a runner that the offloaded step asks a device runner for)."""

    def nonfinite(self, grads: ReducedGrads, inv_scale: float) -> bool:
        """Whether some owned gradient element is NaN/inf (after unscaling); this rank only."""

    def clip(
        self,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        """``clip_grad_norm_`` over the owned gradients: the global norm, applied to this
        step's gradients."""

    def pending_factors(self) -> list[torch.Tensor]:
        """What the reduced gradients must still be multiplied by after unscaling, in order
        (the clip coefficients that this runner applies while filling chunks)."""

    def reset(self) -> None:
        """Forget this step's clip coefficients (after the step, at ``zero_grad``)."""

    @property
    def nbytes(self) -> int:
        """Device memory the runner holds for the step (the chunked scratch)."""


class StepRunner(StepCheck, Protocol):
    def bind(self, used: list[list[bool]]) -> None:
        """The step's gradients are final: expose them to the user's optimizer where it reads
        them outside ``step`` (fp32: ``.grad`` of the used pieces)."""

    def unbind(self) -> None:
        """Forget what ``bind`` exposed (``zero_grad``)."""

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
    ) -> None: ...

    writes_params: bool  # the step writes the parameters itself (else ``publish`` does)

    @property
    def host_nbytes(self) -> dict[str, int]:
        """Host memory held besides the masters and optimizer state, as ``MemoryReport``'s
        ``host_*`` fields (offload; empty otherwise)."""

    @property
    def timing(self) -> dict[str, float] | None:
        """The last complete offloaded step's times ([Note: offload timing] in
        offload/timing.py); None where the step is not offloaded."""


class WholeStep:
    """fp32: the user's optimizer steps views of the reduced gradients."""

    writes_params = False

    def __init__(
        self,
        segments: list[Segment],
        pieces: list[OptimPiece],
        *,
        sharded: bool,
        rank: int,
        device: torch.device,
    ) -> None:
        self.segments = segments
        self.pieces = pieces
        self.sharded = sharded
        self.rank = rank
        self.device = device
        self._finite: FiniteCheck | None = None  # allocated at the first check

    def nonfinite(self, grads: ReducedGrads, inv_scale: float) -> bool:
        if self._finite is None:
            self._finite = FiniteCheck(self.device)
        return self._finite.nonfinite(grads, self.segments, self.rank)

    def bind(self, used: list[list[bool]]) -> None:
        for op in self.pieces:
            op.tensor.grad = op.grad if used[op.seg][op.slot] else None

    def unbind(self) -> None:
        for op in self.pieces:
            op.tensor.grad = None

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
    ) -> None:
        optimizer.step()

    def clip(
        self,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        bound = [op for op in self.pieces if used[op.seg][op.slot]]  # what ``bind`` binds
        return clip_grad_norm(
            [op.grad for op in bound],
            [op.name for op in bound],
            max_norm,
            norm_type,
            scope,
            sharded=self.sharded,
            device=self.device,
        )

    def pending_factors(self) -> list[torch.Tensor]:
        return []  # clipping scaled the reduced gradients in place

    @property
    def host_nbytes(self) -> dict[str, int]:
        return {}

    @property
    def timing(self) -> dict[str, float] | None:
        return None

    def reset(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0


def make_runner(
    segments: list[Segment],
    pieces: list[OptimPiece],
    *,
    mixed: bool,
    sharded: bool,
    rank: int,
    factors: Callable[[], list[torch.Tensor]] | None = None,
) -> StepRunner:
    """The runner for these pieces (rebuilt whenever the pieces are); ``factors``: the clip
    coefficients of another runner that clips for this one (mixed; fp32 clips in place)."""
    if mixed:
        owner = rank if sharded else None
        return ChunkedGrads(segments, pieces, owner=owner, factors=factors)
    device = segments[0].device if segments else torch.device("cpu")
    return WholeStep(segments, pieces, sharded=sharded, rank=rank, device=device)
