"""When a configuration trains "the same" as DDP: one tolerance per precision, and why.

[Note: parity tolerances]
Every configuration of ``zerodp bench`` trains the same model on the same data from the same
seed as DDP; the check compares the two. What "the same" can mean depends on the precision:

- **fp32: the parameters.** The systems run the same arithmetic up to the order of a few sums
  and the optimizer kernel (zerodp picks torch's fused AdamW), so after a handful of steps the
  parameters differ by a few ulps of the largest weights: ``max|p - p_ddp| / max|p_ddp|`` at
  most 1e-5 (measured: 4e-6 and below). A skipped or wrong update moves a parameter by about
  the learning rate (3e-4) per step, 30 times the bound.
- **bf16: the loss curve.** Each system has its own mixed-precision recipe (zerodp keeps bf16
  parameters with fp32 masters; DDP runs ``torch.autocast`` on fp32 parameters; FSDP2 casts fp32
  shards to bf16), so the parameters differ by bf16 roundings, and a weight whose true gradient
  is zero differs by rounding noise that Adam amplifies (worst tensors 1.6 relative, measured):
  no parameter bound separates that from a bug. The loss, computed from bf16 logits in every
  recipe, does: at every step within one bf16 rounding of DDP's, ``|l - l_ddp| / |l_ddp|`` at
  most 2^-8 = 3.9e-3 (measured at 25M, 10 steps: 2.8e-4 for zerodp, 1.9e-4 for FSDP2), while a
  skipped or wrong step moves the loss by that step's own change (2-30% per step in the bench's
  first steps). The parameter figures are reported beside it, not judged.

The figures are reported for every precision; ``judge`` applies the one named here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerodp.apps.bench.systems import PRECISIONS


@dataclass(frozen=True, slots=True)
class Tolerance:
    judged_on: str  # "parameters" or "loss curve"
    bound: float

    def describe(self) -> str:
        if self.judged_on == "parameters":
            return f"parameters: max|p - p_ddp| / max|p_ddp| <= {self.bound:g}"
        return f"loss curve: |loss - loss_ddp| / |loss_ddp| <= {self.bound:.2g} at every step"


TOLERANCES = {
    "fp32": Tolerance("parameters", 1e-5),
    "bf16": Tolerance("loss curve", 2.0**-8),
}
"""See [Note: parity tolerances]."""


def tolerance(precision: str) -> Tolerance:
    try:
        return TOLERANCES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}") from None


def loss_rel_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest ``|l - l_ref| / |l_ref|`` over the steps both ran (inf when they ran a
    different number of steps)."""
    if len(losses) != len(reference) or not reference:
        return float("inf")
    return max(
        abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(losses, reference, strict=True)
    )


def judge(
    parity: Mapping[str, Any],
    losses: Sequence[float],
    reference_losses: Sequence[float] | None,
    precision: str,
) -> dict[str, Any]:
    """``parity`` (``parity.compare_params``'s figures) with the loss curve's figure, the
    tolerance applied and the verdict."""
    tol = tolerance(precision)
    loss = loss_rel_diff(losses, reference_losses) if reference_losses else None
    judged = parity["model_rel_diff"] if tol.judged_on == "parameters" else loss
    return {
        **parity,
        "loss_rel_diff": loss,
        "judged_on": tol.judged_on,
        "tolerance": tol.bound,
        "passed": judged is not None and judged <= tol.bound,
    }
